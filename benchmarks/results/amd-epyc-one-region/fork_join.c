#include <omp.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
volatile float sink[64];
int main(){
  int R=200000;
  for (int rep=0; rep<3; rep++){
  double t0=now();
  for(int r=0;r<R;r++){
    #pragma omp parallel for num_threads(2) schedule(static)
    for(int i=0;i<2;i++) sink[i*16]+=1.f;
  }
  double t1=now();
  #pragma omp parallel num_threads(2)
  for(int r=0;r<R;r++){
    #pragma omp for schedule(static)
    for(int i=0;i<2;i++) sink[i*16]+=1.f;
  }
  double t2=now();
  #pragma omp parallel num_threads(2)
  for(int r=0;r<R;r++){
    #pragma omp single
    sink[0]+=1.f;
  }
  double t3=now();
  printf("parallel for: %.2f us   omp for in one region: %.2f us   single: %.2f us\n",(t1-t0)/R*1e6,(t2-t1)/R*1e6,(t3-t2)/R*1e6);
  }
}
