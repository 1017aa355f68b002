"""What the CUDA sources share: float <-> half conversion without CUDA headers.

Each kernel is a ``__device__`` template over the storage type (compute is fp32) with one
``extern "C" __global__`` entry point per storage type, named after the CudaKernel's
``function`` plus the suffix the cuda backend uses for its own kernels: ``_f32`` (float) and
``_f16`` (float16, carried as its raw 16 bits in an ``unsigned short`` and converted with PTX
``cvt``), so NVRTC compiles the sources with no include path.
"""

STORAGE = {"f32": "float", "f16": "unsigned short"}

PRELUDE = r"""
__device__ __forceinline__ float load_f32(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float load_f32(const unsigned short* p, long long i) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(p[i]));
    return f;
}
__device__ __forceinline__ void store_f32(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f32(unsigned short* p, long long i, float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    p[i] = h;
}
"""


def entry_points(function: str, params: str, args: str) -> str:
    """The extern "C" entry points ``function_f32`` / ``function_f16`` calling the template
    ``function`` (``params`` uses ``T`` for the storage type)."""
    return "".join(
        f'extern "C" __global__ void {function}_{suffix}({params.replace("T", ctype)}) '
        f"{{ {function}({args}); }}\n" for suffix, ctype in STORAGE.items())
