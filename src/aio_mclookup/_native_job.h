/* A native job: work a NativeWorker (_coordinator/_worker_c.c) runs on its own thread without
 * the GIL, for the extension that made it (docs/design.md, "Preparing plans off the loop").
 *
 * A job is a PyCapsule named NATIVE_JOB_CAPSULE whose pointer is a NativeJob: the first member
 * of the maker's own struct, which holds the job's inputs (buffers of immutable objects) and
 * room for its result. A job is submitted once (the worker sets submitted); the worker calls
 * run(job) on its thread, then sets ran (native_job_ran reads it); the maker reads the result
 * (with the GIL) only once ran is set. The capsule's destructor (the maker's) frees the job:
 * the worker holds a reference while the job is queued or running.
 */
#ifndef AIO_MCLOOKUP_NATIVE_JOB_H
#define AIO_MCLOOKUP_NATIVE_JOB_H

#define NATIVE_JOB_CAPSULE "aio_mclookup.native_job"

typedef struct NativeJob {
    void (*run)(struct NativeJob *job); /* no Python API: the GIL is not held */
    int submitted;                      /* set (with the GIL) when a worker takes the job */
    int ran;                            /* set by the worker's thread after run */
} NativeJob;

static inline int
native_job_ran(const NativeJob *job)
{
    return __atomic_load_n(&job->ran, __ATOMIC_ACQUIRE);
}

#endif
