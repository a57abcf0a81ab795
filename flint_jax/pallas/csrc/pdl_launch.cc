// flint_pdl_launch: an XLA FFI custom call that launches a compiled Triton kernel (a cubin) on
// XLA's stream, optionally with programmatic dependent launch (PDL).
//
// Why (docs/kernels.md, sessions 8-11): XLA compiles the Triton IR of every pl.pallas_call
// itself and inserts griddepcontrol.wait at the kernel's entry, so nothing a Pallas kernel does
// -- not even loading weights that no earlier kernel writes -- can overlap its predecessor.
// Here the same Pallas kernel, compiled by the triton package (flint_jax/pallas/ffi_launch.py),
// is launched by us with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION: its CTAs may
// start as soon as the predecessor triggers (or its CTAs exit), and the kernel itself decides
// where griddepcontrol.wait goes (after its weight loads, before it reads any activation).
//
// Operands: the kernel's buffer arguments in Pallas order (inputs, then outputs; an output
// aliased to an input appears in both places, as in XLA's Triton call), then Triton's two
// scratch pointers (null: the kernels use no global scratch; checked in Python).
// Attributes: cubin (u8 array), cubin_hash (its hash, the module cache's key), name, grid_x/y/z,
// threads, shared (dynamic shared bytes), pdl, scratch_params (how many null pointers follow).
//
// The CUDA driver is opened at run time (dlopen of libcuda.so.1), so the library builds without
// a GPU or the CUDA SDK's link stubs; only cuda.h is needed at build time.

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "cuda.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Driver {
  CUresult (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int) = nullptr;
  CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
  CUresult (*CtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  std::string error;
};

const Driver& GetDriver() {
  static Driver* d = [] {
    auto* d = new Driver();
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      d->error = std::string("dlopen(libcuda.so.1) failed: ") + dlerror();
      return d;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && d->error.empty()) d->error = std::string("libcuda lacks ") + name;
    };
    sym(d->ModuleLoadData, "cuModuleLoadData");
    sym(d->ModuleGetFunction, "cuModuleGetFunction");
    sym(d->FuncSetAttribute, "cuFuncSetAttribute");
    sym(d->LaunchKernelEx, "cuLaunchKernelEx");
    sym(d->CtxGetCurrent, "cuCtxGetCurrent");
    sym(d->GetErrorString, "cuGetErrorString");
    return d;
  }();
  return *d;
}

ffi::Error CudaError(const Driver& d, CUresult r, const char* what) {
  const char* s = "unknown";
  if (d.GetErrorString) d.GetErrorString(r, &s);
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("flint_pdl_launch: ") + what + ": " + s);
}

// One CUfunction per (context, cubin): modules are loaded on first use and kept. The cubin is
// known by the hash the caller computed once (hashing it here per launch would cost more than
// the launch).
ffi::ErrorOr<CUfunction> GetFunction(const Driver& d, ffi::Span<const uint8_t> cubin,
                                     int64_t cubin_hash, std::string_view name,
                                     int64_t shared) {
  static std::mutex mu;
  static auto* cache = new std::unordered_map<std::string, CUfunction>();
  CUcontext ctx = nullptr;
  CUresult r = d.CtxGetCurrent(&ctx);
  if (r != CUDA_SUCCESS) return ffi::Unexpected(CudaError(d, r, "cuCtxGetCurrent"));
  std::string key(reinterpret_cast<const char*>(&ctx), sizeof(ctx));
  key.append(reinterpret_cast<const char*>(&cubin_hash), sizeof(cubin_hash));
  key.append(name);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  std::vector<uint8_t> image(cubin.begin(), cubin.end());
  CUmodule mod;
  r = d.ModuleLoadData(&mod, image.data());
  if (r != CUDA_SUCCESS) return ffi::Unexpected(CudaError(d, r, "cuModuleLoadData"));
  CUfunction fn;
  std::string cname(name);
  r = d.ModuleGetFunction(&fn, mod, cname.c_str());
  if (r != CUDA_SUCCESS) return ffi::Unexpected(CudaError(d, r, "cuModuleGetFunction"));
  if (shared > 48 * 1024) {
    r = d.FuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                           static_cast<int>(shared));
    if (r != CUDA_SUCCESS) return ffi::Unexpected(CudaError(d, r, "cuFuncSetAttribute"));
  }
  (*cache)[key] = fn;
  return fn;
}

ffi::Error Launch(CUstream stream, ffi::RemainingArgs args, ffi::RemainingRets rets,
                  ffi::Span<const uint8_t> cubin, int64_t cubin_hash, std::string_view name,
                  int64_t grid_x,
                  int64_t grid_y, int64_t grid_z, int64_t threads, int64_t shared, bool pdl,
                  int64_t scratch_params) {
  const Driver& d = GetDriver();
  if (!d.error.empty()) return ffi::Error(ffi::ErrorCode::kUnavailable, d.error);
  auto fn = GetFunction(d, cubin, cubin_hash, name, shared);
  if (fn.has_error()) return fn.error();

  std::vector<void*> ptrs;
  ptrs.reserve(args.size() + rets.size() + scratch_params);
  for (size_t i = 0; i < args.size(); ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    ptrs.push_back(b->untyped_data());
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (b.has_error()) return b.error();
    ptrs.push_back((*b)->untyped_data());
  }
  for (int64_t i = 0; i < scratch_params; ++i) ptrs.push_back(nullptr);
  std::vector<void*> params(ptrs.size());
  for (size_t i = 0; i < ptrs.size(); ++i) params[i] = &ptrs[i];

  CUlaunchAttribute attr[1];
  std::memset(attr, 0, sizeof(attr));
  attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr[0].value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.gridDimX = static_cast<unsigned>(grid_x);
  cfg.gridDimY = static_cast<unsigned>(grid_y);
  cfg.gridDimZ = static_cast<unsigned>(grid_z);
  cfg.blockDimX = static_cast<unsigned>(threads);
  cfg.blockDimY = 1;
  cfg.blockDimZ = 1;
  cfg.sharedMemBytes = static_cast<unsigned>(shared);
  cfg.hStream = stream;
  cfg.attrs = pdl ? attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  CUresult r = d.LaunchKernelEx(&cfg, *fn, params.data(), nullptr);
  if (r != CUDA_SUCCESS) return CudaError(d, r, "cuLaunchKernelEx");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlintPdlLaunch, Launch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<CUstream>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const uint8_t>>("cubin")
                                  .Attr<int64_t>("cubin_hash")
                                  .Attr<std::string_view>("name")
                                  .Attr<int64_t>("grid_x")
                                  .Attr<int64_t>("grid_y")
                                  .Attr<int64_t>("grid_z")
                                  .Attr<int64_t>("threads")
                                  .Attr<int64_t>("shared")
                                  .Attr<bool>("pdl")
                                  .Attr<int64_t>("scratch_params"));
