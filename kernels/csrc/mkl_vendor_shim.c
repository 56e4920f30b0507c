/* Answers oneMKL's "is this an Intel CPU?" query with yes.
 *
 * oneMKL (linked into libtorch_cpu.so) picks its code path from this answer before it looks at
 * the CPU's feature bits: on any other vendor it runs its generic kernels, even on CPUs with
 * AVX2 or AVX-512. libtorch_cpu.so calls the query through its PLT, so a definition loaded
 * into the process's global symbol scope before torch wins the lookup, and oneMKL then chooses
 * by the feature bits alone (AVX-512 on Zen 4, AVX2 on Zen 2/3). See kernels/mkl_vendor.py.
 */
int mkl_serv_intel_cpu_true(void) { return 1; }
