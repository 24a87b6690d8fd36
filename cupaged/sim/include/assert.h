// Shadows <assert.h> on the sim: a failed device assert is a SimTrapError, as on the GPU a trap.
#undef assert
#ifdef NDEBUG
#define assert(e) ((void)0)
#else
namespace cupaged_sim { [[noreturn]] void trap(const char* what, const char* file, int line); }
#define assert(e) ((e) ? (void)0 : ::cupaged_sim::trap("assertion failed: " #e, __FILE__, __LINE__))
#endif
