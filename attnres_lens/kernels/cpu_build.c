/* What this build of the kernels is, for cpu_build.py and the tests: whether it runs the vector sums, and whether
 * its threads are OpenMP's (torch's pool) or pthreads started per call (docs/kernels.md §6). */
#include "cpu_kernels.h"

/* Whether this build runs the vector sums (tests tell the builds apart by it). */
int vector_sums(void) { return VECTOR_SUMS; }

/* The OpenMP runtime's thread count for the calling thread, 0 in a build without OpenMP: with torch's runtime
 * shared, it follows torch.set_num_threads (tests tell the builds apart, and the runtimes, by it). */
int openmp_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 0;
#endif
}
