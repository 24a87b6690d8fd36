"""Command line: ``python -m cupaged demo [--verify]`` (serve requests on a tiny decoder), ``python -m cupaged
selftest [--backend sim|cuda]`` (every kernel against its reference) and ``python -m cupaged resources``."""

from __future__ import annotations

import argparse
import sys

DESCRIPTION = ("cupaged's commands: demo serves requests on a tiny decoder, selftest runs every kernel against its "
               "reference, resources is the NVRTC compile gate. Each takes --help.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cupaged", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    # no help of its own: `demo --help` reaches cupaged.demo.cli, which lists its options
    sub.add_parser("demo", add_help=False, help="serve requests on a tiny decoder with continuous batching "
                   "(--verify: against a float64 forward)")
    st = sub.add_parser("selftest", help="run every kernel on a small case against the numpy reference")
    st.add_argument("--backend", choices=("sim", "cuda"), help="default: cuda when a GPU is present, else sim")
    # no help of its own: `resources --help` reaches cupaged.resources, which lists its options
    sub.add_parser("resources", add_help=False,
                   help="NVRTC compile gate: registers and spills per kernel (sm_80, sm_90; sm_90a for Hopper "
                        "families), results cached")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from cupaged.demo.cli import main as demo_main

        return demo_main(rest)
    if args.command == "selftest":
        from cupaged.selftest import run

        return run(args.backend)
    from cupaged.resources import main as resources_main

    return resources_main(rest)


if __name__ == "__main__":
    sys.exit(main())
