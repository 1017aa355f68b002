/* OpenBLAS's threads callback (openblas_set_threads_callback_function, OpenBLAS >= 0.3.27):
 * the jobs of one parallel BLAS call run on libgomp's worker threads, the pool oneDNN runs
 * on, so the numpy backend keeps one pool of workers instead of two (tr_onnx/blas_threads.py
 * builds this file with the C compiler and installs the callback). */
#include <omp.h>
#include <pthread.h>
#include <stddef.h>

typedef void (*dojob_fn)(int thread_num, void *jobdata, int dojob_data);

/* parallel BLAS calls run through here (tests read it; updated under the lock) */
long tr_onnx_blas_parallel_calls = 0;

/* OpenBLAS hands job i its per-thread buffer i: two callers at once would share them */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

struct job {
    dojob_fn dojob;
    int index;
    void *data;
    int dojob_data;
};

static void *run_job(void *arg) {
    struct job *j = arg;
    j->dojob(j->index, j->data, j->dojob_data);
    return NULL;
}

/* Jobs on threads of their own: where OpenMP cannot give a team of numjobs threads (inside
 * another parallel region, OMP_THREAD_LIMIT, OMP_DYNAMIC). Never one thread running two jobs:
 * a level-3 call's jobs wait for each other's packed panels. */
static void run_on_pthreads(dojob_fn dojob, int numjobs, size_t elsize, char *jobdata,
                            int dojob_data) {
    pthread_t threads[64];
    struct job jobs[64];
    int started = 0;
    for (int i = 1; i < numjobs && i < 64; i++) {
        jobs[i] = (struct job){dojob, i, jobdata + (size_t)i * elsize, dojob_data};
        if (pthread_create(&threads[i], NULL, run_job, &jobs[i]) != 0)
            break;
        started = i;
    }
    dojob(0, jobdata, dojob_data);
    for (int i = started + 1; i < numjobs; i++) /* could not start: run them here, in order */
        dojob(i, jobdata + (size_t)i * elsize, dojob_data);
    for (int i = 1; i <= started; i++)
        pthread_join(threads[i], NULL);
}

void tr_onnx_run_blas_jobs(int sync, dojob_fn dojob, int numjobs, size_t elsize,
                           void *jobdata, int dojob_data) {
    (void)sync;
    pthread_mutex_lock(&lock);
    tr_onnx_blas_parallel_calls++;
    int team = 0;
    if (!omp_in_parallel()) {
#pragma omp parallel num_threads(numjobs)
        {
#pragma omp single
            team = omp_get_num_threads();
            /* the single's barrier: every thread sees the team size before choosing */
            if (team == numjobs) {
                int i = omp_get_thread_num();
                dojob(i, (char *)jobdata + (size_t)i * elsize, dojob_data);
            }
        }
    }
    if (team != numjobs)
        run_on_pthreads(dojob, numjobs, elsize, jobdata, dojob_data);
    pthread_mutex_unlock(&lock);
}

typedef void (*setter_fn)(void *callback);
static setter_fn installed = NULL;

/* A forked child has none of libgomp's worker threads, and libgomp does not know it: a
 * parallel region there waits for them forever (seen: the child's first GEMM hung). In the
 * child OpenBLAS goes back to its own threads, which its fork handler restarts. (oneDNN's
 * regions hang there the same way, with or without this file: tr_onnx's oneDNN kernels
 * cannot run in a forked child.) */
static void in_forked_child(void) {
    if (installed != NULL)
        installed(NULL);
}

/* Install the callback through OpenBLAS's setter (its name varies by build: Python finds
 * it); 0 on success. */
int tr_onnx_share_blas_threads(setter_fn setter) {
    if (pthread_atfork(NULL, NULL, in_forked_child) != 0)
        return -1;
    installed = setter;
    setter((void *)tr_onnx_run_blas_jobs);
    return 0;
}
