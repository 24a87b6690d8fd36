"""The CPU simulator's own tests (cupaged.sim): its engine, PTX layer, profiler and H200 model."""
