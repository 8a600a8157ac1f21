// Finds this process's remote engine for the cpu backend. The MPI engine is
// a library of its own (libsymheap_mpi.so, next to the module that holds the
// core), opened only when MPI is already loaded in the process: a process
// that never loaded MPI cannot have initialised it, and `import symheap`
// must never pull libmpi in.
#include <dlfcn.h>
#include <link.h>
#include <limits.h>
#include <stdlib.h>

#include <cstring>
#include <mutex>
#include <string>

#include "transports/remote_engine_loader.hpp"

namespace symheap {
namespace remote {

std::string beside_core(const char* file) {
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&beside_core), &info) || !info.dli_fname) return file;
  char real[PATH_MAX];
  std::string self = realpath(info.dli_fname, real) ? real : info.dli_fname;
  size_t slash = self.rfind('/');
  return (slash == std::string::npos ? std::string() : self.substr(0, slash + 1)) + file;
}

void* symbol_beside_core(const char* file, const char* symbol, const std::string& what,
                         std::string* why_not, std::string* path) {
  const std::string where = beside_core(file);
  if (path) *path = where;
  void* lib = dlopen(where.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* err = dlerror();
    *why_not = "cannot load " + what + " " + where + ": " + (err ? err : "unknown error");
    return nullptr;
  }
  void* found = dlsym(lib, symbol);
  if (!found) *why_not = where + " has no " + symbol + ": rebuild symheap";
  return found;  // (the library stays loaded: closing it buys nothing)
}

#ifdef SYMHEAP_MPI_ENGINE_FILE
namespace {

// Whether a libmpi (Open MPI's libmpi.so.40, MPICH's libmpi.so.12, ...) is mapped.
bool mpi_is_loaded() {
  return dl_iterate_phdr(
             [](dl_phdr_info* info, size_t, void*) -> int {
               const char* name = info->dlpi_name ? std::strrchr(info->dlpi_name, '/') : nullptr;
               name = name ? name + 1 : info->dlpi_name;
               return name && std::strncmp(name, "libmpi.so", 9) == 0;
             },
             nullptr) != 0;
}

}  // namespace

Engine* process_engine(std::string* why_not) {
  static std::mutex mu;
  static Engine* engine = nullptr;  // kept for the life of the process
  std::lock_guard<std::mutex> lock(mu);
  if (engine) return engine;
  if (!mpi_is_loaded()) {
    *why_not = "this process has no MPI: launch with mpirun and init with symheap.init_mpi "
               "(or import mpi4py.MPI before symheap.init), so the MPI engine can carry "
               "remote traffic";
    return nullptr;
  }
  auto open = reinterpret_cast<OpenFn>(
      symbol_beside_core(SYMHEAP_MPI_ENGINE_FILE, kOpenSymbol, "the MPI engine", why_not));
  if (!open) return nullptr;
  std::string why;
  engine = open(kEngineAbi, &why);
  if (!engine) *why_not = "the MPI engine is unavailable: " + why;
  return engine;
}

#else

Engine* process_engine(std::string* why_not) {
  *why_not = "symheap was built without the MPI engine (" SYMHEAP_MPI_MISSING
             "): install OpenMPI (scripts/setup.sh: openmpi-bin libopenmpi-dev) and rebuild "
             "with SYMHEAP_MPI=ON";
  return nullptr;
}

#endif

}  // namespace remote
}  // namespace symheap
