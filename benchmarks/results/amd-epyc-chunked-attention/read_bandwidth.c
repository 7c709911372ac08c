/* The read-bandwidth probe behind read-bandwidth.txt: gcc -O3 -march=native -fopenmp read_bandwidth.c -o bw && ./bw */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
int main(){
  size_t n = (size_t)512 << 20 >> 2; float* a; posix_memalign((void**)&a, 64, n*4);
  for (size_t i=0;i<n;i++) a[i]=1.0f;
  for (int th=1; th<=2; th++) for (int rep=0; rep<3; rep++){
    double t=omp_get_wtime(); float total=0;
    #pragma omp parallel num_threads(th) reduction(+:total)
    { __m512 s0=_mm512_setzero_ps(), s1=s0, s2=s0, s3=s0;
      #pragma omp for schedule(static)
      for (size_t i=0;i<n;i+=64){ s0=_mm512_add_ps(s0,_mm512_load_ps(a+i)); s1=_mm512_add_ps(s1,_mm512_load_ps(a+i+16)); s2=_mm512_add_ps(s2,_mm512_load_ps(a+i+32)); s3=_mm512_add_ps(s3,_mm512_load_ps(a+i+48)); }
      total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0,s1),_mm512_add_ps(s2,s3))); }
    double s=omp_get_wtime()-t; printf("threads %d: %.1f GB/s (%g)\n", th, n*4/s/1e9, total);
  }
}
