// XLA FFI handlers that run torch's own CPU kernels (oneDNN convolutions) inside an
// XLA:CPU executable, on the buffers XLA hands them: the executable stays one asynchronous
// PJRT call, and only the op XLA:CPU is slow at leaves its code generator.
//
// Each handler wraps XLA's dense row-major buffers as torch tensors without copying, calls the
// ATen op with the dispatcher's extra layers excluded (XLA may run the handler on a thread
// where a Python dispatch mode or autograd is active; neither may see this call), and writes
// the result into XLA's output buffer.
#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mkldnn_reorder_conv2d_weight.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/ConvUtils.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <atomic>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include <dlfcn.h>
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>


#if AT_PARALLEL_OPENMP
#include <omp.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// For the length of one handler call, the dispatcher skips every layer the calling thread may
// have switched on (a Python dispatch mode, functorch transforms, vmap, autocast, tracing,
// functionalization) and autograd, so the op goes straight to its CPU kernel.
c10::DispatchKeySet skipped_layers() {
  using K = c10::DispatchKey;
  return c10::autograd_dispatch_keyset_with_ADInplaceOrView | c10::autocast_dispatch_keyset |
         c10::DispatchKeySet({K::Python, K::PythonTLSSnapshot, K::PreDispatch, K::Functionalize,
                              K::FuncTorchDynamicLayerFrontMode, K::FuncTorchDynamicLayerBackMode,
                              K::FuncTorchBatched, K::FuncTorchVmapMode, K::Batched, K::VmapMode,
                              K::Tracer});
}

std::optional<c10::ScalarType> torch_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return c10::ScalarType::Float;
    case ffi::DataType::F64: return c10::ScalarType::Double;
    case ffi::DataType::BF16: return c10::ScalarType::BFloat16;
    case ffi::DataType::F16: return c10::ScalarType::Half;
    default: return std::nullopt;
  }
}

at::Tensor as_tensor(const ffi::AnyBuffer& b, c10::ScalarType dtype) {
  auto dims = b.dimensions();
  std::vector<int64_t> sizes(dims.begin(), dims.end());
  return at::from_blob(b.untyped_data(), sizes, at::TensorOptions().dtype(dtype));
}

template <typename Attr>
std::vector<int64_t> ints(Attr span) {
  return std::vector<int64_t>(span.begin(), span.end());
}

// Runs `body`, turning a C++ exception (a torch check) into an FFI error XLA reports.
template <typename F>
ffi::Error guarded(const char* what, F&& body) {
  try {
    c10::impl::ExcludeDispatchKeyGuard plain(skipped_layers());
    body();
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + ": " + e.what());
  }
}

// Batch splitting. Called from one of XLA's threads, torch's kernel would run its OpenMP team
// there: a team of its own for every XLA thread that calls one, whose workers then spin (GNU
// OpenMP waits actively for milliseconds after each region) on the cores XLA's next fusions need.
// Where the batch has several samples, the handlers instead cut it into one slice per thread of
// XLA's intra-op pool and run each slice single-threaded on XLA's own threads: no OpenMP team is
// ever started from an XLA thread. (Where the main thread serves its execution, the matmul and
// convolution handlers hand it their whole work instead: "Serving", below.)

// torch single-threaded on this thread for the scope (OpenMP's thread-count setting is per
// thread); restored after, since the caller may be a thread torch uses itself. torch sets each
// thread's count lazily, to its own global one, on the thread's first parallel call or
// at::get_num_threads(): that runs first here, or it would undo the setting inside the first slice
// a thread runs (a team of torch's threads started from XLA's thread, and a kernel chosen for
// several threads: torch picks oneDNN for 1x1 filters only then).
//
// MKL (torch's BLAS on x86) keeps a count of its own, and takes it instead of OpenMP's. Once the
// process called torch.set_num_threads, torch has made that count explicit (MKL's dynamic
// adjustment off) and sets it on every thread torch initializes, this one included. A gemm the
// kernel calls here, outside any parallel region, would then start MKL's own team of that many
// threads from XLA's thread, and its blocking for several threads gives other bits than eager's
// call, which runs MKL inside torch's parallel region on one thread (a 37-row attention: 1.8e-7
// apart). MKL's count for this thread is 1 for the scope too, where torch's library has MKL: the
// MKL linked into libtorch_cpu, looked up there (another MKL the process may hold has counts of
// its own), through its Fortran-style entry, which takes the count by address.
using MklSetLocal = int (*)(const int*);
MklSetLocal mkl_set_local() {
  static const MklSetLocal fn = []() -> MklSetLocal {
#if AT_MKL_ENABLED()
    if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD))
      return reinterpret_cast<MklSetLocal>(dlsym(lib, "mkl_set_num_threads_local_"));
#endif
    return nullptr;
  }();
  return fn;
}

class SingleThreaded {
 public:
#if AT_PARALLEL_OPENMP
  SingleThreaded() : saved_((at::get_num_threads(), omp_get_max_threads())), mkl_(mkl_set_local()) {
    omp_set_num_threads(1);
    if (mkl_) {
      int one = 1;
      mkl_saved_ = mkl_(&one);  // the thread's own count before: 0 is none
    }
  }
  ~SingleThreaded() {
    omp_set_num_threads(saved_);
    if (mkl_) mkl_(&mkl_saved_);
  }

 private:
  int saved_;
  MklSetLocal mkl_;
  int mkl_saved_ = 0;
#endif
};

std::atomic<bool> slicing{true};  // fx2xla_torch_kernels_set_slicing
std::atomic<int64_t> sliced_calls{0};  // fx2xla_torch_kernels_sliced_calls
// Parts of every split (run_split) so far, and how many of them a thread other than the caller
// ran: where the second stays near 0, the splits ran on the caller alone (fx2xla_split_parts).
std::atomic<int64_t> split_parts{0};
std::atomic<int64_t> split_parts_elsewhere{0};
// Whether a split's caller polls briefly for the parts still running elsewhere before it sleeps
// (wait_split_briefly; fx2xla_set_split_spin, for A/B measurements).
std::atomic<bool> split_spin{true};
// Splits whose caller, out of parts to claim, found parts still running elsewhere; of those, the
// ones whose caller polled for them, and the ones whose parts all ended while it polled.
std::atomic<int64_t> split_waits{0}, split_polled{0}, split_polled_out{0};

// The cores this process may run on (its affinity mask): XLA's pool may hold more threads than
// that (one per virtual device, say), and slices beyond the cores would only queue.
int64_t usable_cores() {
  static const int64_t cores = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return static_cast<int64_t>(CPU_COUNT(&set));
    return static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  }();
  return cores;
}

// How many slices to cut a batch of `n` into: one per usable intra-op thread where each gets two
// samples or more (with one sample per thread, torch's own threads were as fast: docs/
// benchmarks.md), else 1 (torch's threads); 1 where torch does not run on OpenMP (no team is
// started from ours then).
int64_t slices(int64_t n, const ffi::ThreadPool& pool) {
#if AT_PARALLEL_OPENMP
  int64_t threads = std::min(pool.num_threads(), usable_cores());
  if (!slicing.load(std::memory_order_relaxed)) return 1;
  return threads > 1 && n >= 2 * threads ? threads : 1;
#else
  return 1;
#endif
}

// Runs body(i) for i in [0, parts): the calling thread and helpers claim indices from a shared
// counter, so the caller never waits for a helper that has not started (the pool's threads may
// all be busy, or waiting in handlers of their own); a helper that starts after every index is
// claimed returns at once. The helpers are the library's helper threads where the call asked for
// them (Helping, below), else tasks on XLA's pool. The first exception is rethrown here once all
// have ended.
struct SplitState {
  std::atomic<int64_t> next{0};
  int64_t parts = 0;
  bool calls_torch = true;  // each part runs torch ops: single-threaded, with the layers skipped
  const std::function<void(int64_t)>* body = nullptr;  // read only by a thread holding a claim
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<int64_t> finished{0};
  std::exception_ptr error;  // guarded by mu

  // Runs parts until none is left to claim; returns how many this thread ran.
  int64_t work() {
    int64_t ran = 0;
    for (int64_t i; (i = next.fetch_add(1)) < parts; ++ran) {
      std::exception_ptr failed;
      try {
        if (calls_torch) {
          c10::impl::ExcludeDispatchKeyGuard plain(skipped_layers());
          SingleThreaded one;
          (*body)(i);
        } else {
          (*body)(i);
        }
      } catch (...) {
        failed = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu);
      if (failed && !error) error = failed;
      if (finished.fetch_add(1) + 1 == parts) cv.notify_all();
    }
    return ran;
  }
};

// Helpers. Waking a sleeping thread took 100-200 us on the 2-core VMs this was measured on,
// about what one split matmul of a decode step takes, so a split handed to XLA's pool often ran
// on the caller alone. While an execution that asked for help runs (fx2xla_help_begin / _end,
// around the launch of an executable with few-row matmuls), the library's helper threads poll
// this slot instead of sleeping, and claim a posted split's parts at once; with no execution
// asking, they sleep (a helper that spun on past the execution took the core that the caller's
// own work between calls needed). One split is posted at a time (others go to XLA's pool); its
// state is shared, so a helper that took it late finds no part left and lets go. The state is
// never destroyed: a helper may sleep on it while the process exits.
struct Helping {
  std::mutex mu;                    // guards `asking` changes and the sleep
  std::condition_variable wake;
  std::atomic<int64_t> asking{0};   // executions that asked for help and have not ended
  std::atomic<int> spinning{0};     // helpers polling the slot now
  std::atomic<bool> posted{false};
  std::mutex posted_mu;
  std::shared_ptr<SplitState> split;  // the posted split, guarded by posted_mu
  std::atomic<int64_t> parts{0};      // parts helpers ran (fx2xla_helped_parts)
  std::once_flag started;
};
Helping& helping = *new Helping;

bool post_split(const std::shared_ptr<SplitState>& state) {
  if (helping.spinning.load(std::memory_order_acquire) == 0) return false;
  std::lock_guard<std::mutex> lock(helping.posted_mu);
  if (helping.split) return false;
  helping.split = state;
  helping.posted.store(true, std::memory_order_release);
  return true;
}

void take_back_split(const std::shared_ptr<SplitState>& state) {
  std::lock_guard<std::mutex> lock(helping.posted_mu);
  if (helping.split == state) {
    helping.split.reset();
    helping.posted.store(false, std::memory_order_release);
  }
}

// A helper thread: sleeps until an execution asks, then runs posted parts until none asks.
void helper_loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(helping.mu);
      helping.wake.wait(lock, [] { return helping.asking.load(std::memory_order_acquire) > 0; });
    }
    helping.spinning.fetch_add(1, std::memory_order_acq_rel);
    while (helping.asking.load(std::memory_order_acquire) > 0) {
      if (helping.posted.load(std::memory_order_acquire)) {
        std::shared_ptr<SplitState> split;
        {
          std::lock_guard<std::mutex> lock(helping.posted_mu);
          split = helping.split;
        }
        if (split) {
          helping.parts.fetch_add(split->work(), std::memory_order_relaxed);
          continue;
        }
      }
      // Nothing to run: the core goes to any other thread that wants it (XLA's own, mid-
      // execution), and this one polls again as soon as none does.
      sched_yield();
    }
    helping.spinning.fetch_sub(1, std::memory_order_acq_rel);
  }
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A caller that has run out of parts to claim waits for the parts other threads still run. Those
// end within about one part's time of the caller's last, which for short parts is shorter than
// waking from a sleep (39 us per split on a 2-vCPU AMD EPYC VM, 13 splits in a LLaMA 4L decode
// step at 8 rows: docs/benchmarks.md, "Split waits polled"). So where the caller's own parts took
// kMaxSplitSpin / 2 or less on average, it polls first, for up to twice that mean, and sleeps
// only past it. Longer parts (convolution or gemm slices of a millisecond) sleep at once: the
// wake-up is small beside them, and a polling caller would hold a core that XLA's other work in
// flight may need.
constexpr auto kMaxSplitSpin = std::chrono::microseconds(200);

void wait_split_briefly(const std::atomic<int64_t>& finished, int64_t parts, std::chrono::nanoseconds per_part) {
  if (!split_spin.load(std::memory_order_relaxed) || per_part > kMaxSplitSpin / 2) return;
  split_polled.fetch_add(1, std::memory_order_relaxed);
  auto deadline = std::chrono::steady_clock::now() + 2 * per_part;
  for (int i = 1; finished.load(std::memory_order_acquire) < parts; ++i) {
    cpu_relax();
    if (i % 32 == 0 && std::chrono::steady_clock::now() >= deadline) return;
  }
  split_polled_out.fetch_add(1, std::memory_order_relaxed);
}

// How many helper threads: one per usable core past the caller's, at most 3 (measured with one,
// on 2 cores; beyond a few, the splits of a decode step's matmuls are bound by memory).
int64_t helper_count() { return std::min<int64_t>(usable_cores() - 1, 3); }

// `helpers`: at most this many tasks go to XLA's pool (by default one per part past the first),
// fewer by the helper threads polling where the split is posted to them.
void run_split(int64_t parts, ffi::ThreadPool& pool, const std::function<void(int64_t)>& body,
               bool calls_torch = true, int64_t helpers = -1) {
  if (calls_torch) sliced_calls.fetch_add(1, std::memory_order_relaxed);
  auto state = std::make_shared<SplitState>();
  state->parts = parts;
  state->calls_torch = calls_torch;
  state->body = &body;
  bool posted = post_split(state);
  int64_t tasks = helpers < 0 ? parts - 1 : std::min(parts - 1, helpers);
  if (posted) tasks = std::max<int64_t>(0, tasks - helping.spinning.load(std::memory_order_acquire));
  for (int64_t i = 0; i < tasks; ++i) pool.Schedule([state] { state->work(); });
  auto started = std::chrono::steady_clock::now();
  int64_t mine = state->work();
  split_parts.fetch_add(parts, std::memory_order_relaxed);
  split_parts_elsewhere.fetch_add(parts - mine, std::memory_order_relaxed);
  if (posted) {
    take_back_split(state);
    // The helpers are running: whatever part one holds ends sooner than a sleep's wake-up would.
    while (state->finished.load(std::memory_order_acquire) < parts) cpu_relax();
  } else if (state->finished.load(std::memory_order_acquire) < parts) {
    split_waits.fetch_add(1, std::memory_order_relaxed);
    if (mine > 0) wait_split_briefly(state->finished, parts, (std::chrono::steady_clock::now() - started) / mine);
  }
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->finished.load(std::memory_order_acquire) == parts; });
  if (state->error) std::rethrow_exception(state->error);
}

// Serving. The handlers above run torch's kernels on XLA's threads, one single-threaded slice
// each, while torch's own team (the main thread and its OpenMP workers, which eager and Inductor
// run on) sits parked or idle. A call from the main thread of an executable that calls the matmul
// or convolution handler instead serves them for the length of its execution
// (plan_executor: Specialization.served): it launches, then runs every product or convolution
// the handlers post here, whole, on torch's team, until the execution's results are ready. A
// handler posts where a server is active and waits for its work to be done; otherwise it runs as
// before. The main thread owns torch's team, so only it serves; work posted by other threads'
// executions meanwhile is served too. Work still queued when serving ends is run by the server
// before it leaves, so a handler that posted never waits on nobody. The state is never
// destroyed: a handler may be waiting on it while the process exits.
struct Served {
  const std::function<void()>* work = nullptr;
  bool done = false;  // guarded by Server::mu
  std::exception_ptr error;
};
struct Server {
  std::mutex mu;
  std::condition_variable posted, finished;
  std::deque<Served*> queue;  // guarded by mu
  bool active = false;        // guarded by mu
  bool ended = false;         // the served execution's results are ready; guarded by mu
  pthread_t thread{};         // the serving thread while active; guarded by mu
};
Server& server = *new Server;
std::atomic<bool> serving{false};  // fx2xla_torch_kernels_set_serving (torch_kernels.serving_on)
std::atomic<int64_t> served_calls{0};  // fx2xla_served_calls

// Runs the queue's first item, unlocked; `lock` holds server.mu on entry and on return.
void serve_one(std::unique_lock<std::mutex>& lock) {
  Served* item = server.queue.front();
  server.queue.pop_front();
  lock.unlock();
  try {
    c10::impl::ExcludeDispatchKeyGuard plain(skipped_layers());
    (*item->work)();
  } catch (...) {
    item->error = std::current_exception();
  }
  served_calls.fetch_add(1, std::memory_order_relaxed);
  lock.lock();
  item->done = true;
  server.finished.notify_all();
}

// `work` run by the server, its exception rethrown here; false (nothing run) where none serves.
// PJRT may run a small execution's thunks on the launching thread itself: a handler called on
// the serving thread runs its work there and then, on the team it owns.
bool run_served(const std::function<void()>& work) {
  if (!serving.load(std::memory_order_relaxed)) return false;
  Served item;
  item.work = &work;
  std::unique_lock<std::mutex> lock(server.mu);
  if (!server.active) return false;
  if (pthread_equal(server.thread, pthread_self())) {
    lock.unlock();
    work();
    served_calls.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  server.queue.push_back(&item);
  server.posted.notify_one();
  server.finished.wait(lock, [&] { return item.done; });
  if (item.error) std::rethrow_exception(item.error);
  return true;
}

}  // namespace

extern "C" void fx2xla_serve_begin() {
  std::lock_guard<std::mutex> lock(server.mu);
  server.active = true;
  server.ended = false;
  server.thread = pthread_self();
}

// Runs what is posted until fx2xla_serve_ended is called (by the thread that waits for the
// execution's results), sleeping in between. The GIL is released around it (ctypes).
extern "C" void fx2xla_serve_until_ended() {
  std::unique_lock<std::mutex> lock(server.mu);
  for (;;) {
    server.posted.wait(lock, [] { return server.ended || !server.queue.empty(); });
    while (!server.queue.empty()) serve_one(lock);
    if (server.ended) return;
  }
}

extern "C" void fx2xla_serve_ended() {
  std::lock_guard<std::mutex> lock(server.mu);
  server.ended = true;
  server.posted.notify_all();
}

extern "C" void fx2xla_serve_end() {
  std::unique_lock<std::mutex> lock(server.mu);
  server.active = false;
  while (!server.queue.empty()) serve_one(lock);
}

extern "C" int fx2xla_torch_kernels_set_serving(int on) { return serving.exchange(on != 0); }
extern "C" int64_t fx2xla_served_calls() { return served_calls.load(); }

namespace {

// [begin, end) of slice i of n samples cut into `parts`.
std::pair<int64_t, int64_t> slice_bounds(int64_t i, int64_t n, int64_t parts) {
  return {i * n / parts, (i + 1) * n / parts};
}

// A channels-last buffer ([N, *spatial, C], XLA's row-major) as the logical NCHW tensor torch
// sees, with channels-last strides: oneDNN then runs its channels-last kernels, as Inductor's
// layout optimization makes it for convolutions.
at::Tensor channels_last(const at::Tensor& t) {
  std::vector<int64_t> order{0, t.dim() - 1};
  for (int64_t d = 1; d < t.dim() - 1; ++d) order.push_back(d);
  return t.permute(order);
}

// Packed weights. oneDNN's convolution reads its weight in a blocked layout of its own; handed a
// plain weight, torch's kernel reorders it into that layout on every call, and with the batch cut
// into slices, once per slice (for 512 -> 512 3x3 at 2x2, 4.3 ms of a 5.1 ms slice). fx2xla pins
// the buffer of each resident convolution weight of an inference graph while it is current: a
// relaid copy, or torch's own memory for weights it holds channels-last. The executor holds the
// jax array while pinned, so the address is not reused, and imports (and pins) a weight again
// once its version moves, so a pinned buffer's bytes are the weight's current values. A
// convolution whose weight is a pinned buffer reorders it once per shape, keeps the packed copy
// until the buffer is unpinned, and runs torch's convolution on it (mkldnn::_convolution_pointwise,
// the op Inductor calls on weights it packs when freezing): the same oneDNN primitive, bit for bit
// the plain call's result.
struct Pack {
  std::vector<int64_t> key;  // w's and x's sizes, stride, padding, dilation, groups, dtype
  at::Tensor weight;         // undefined: packing or the packed call failed; the plain path runs
};
struct PinnedWeight {
  size_t bytes = 0;
  std::vector<Pack> packs;
};
// Distinct shapes packed per weight (a bound on the memory packs take); further shapes take the
// plain path.
constexpr size_t kMaxPacksPerWeight = 4;

std::mutex pinned_mu;
std::unordered_map<const void*, PinnedWeight> pinned;  // guarded by pinned_mu
std::atomic<int64_t> pinned_count{0};
std::atomic<bool> packing{true};     // fx2xla_torch_kernels_set_packing
std::atomic<int64_t> packs_made{0};  // fx2xla_torch_kernels_packs_made
std::atomic<int64_t> packed_calls{0};  // fx2xla_torch_kernels_packed_calls
std::atomic<int64_t> written_in_place{0};  // fx2xla_torch_kernels_written_in_place
std::atomic<bool> in_place{true};  // fx2xla_torch_kernels_set_in_place

std::vector<int64_t> pack_key(const at::Tensor& w, const at::Tensor& x, ffi::Span<const int64_t> stride,
                              ffi::Span<const int64_t> padding, ffi::Span<const int64_t> dilation, int64_t groups) {
  std::vector<int64_t> key(w.sizes().begin(), w.sizes().end());
  key.insert(key.end(), x.sizes().begin(), x.sizes().end());
  for (auto span : {stride, padding, dilation}) {
    key.push_back(-1);
    key.insert(key.end(), span.begin(), span.end());
  }
  key.push_back(groups);
  key.push_back(static_cast<int64_t>(x.scalar_type()));
  return key;
}

// The packed copy of pinned weight `w` (its bytes at `data`) for a convolution of `x`, packed now
// if it is not yet; nullopt where `data` is not pinned, packing is off or failed, or torch's own
// convolution would not run oneDNN on this shape (a small one it gives its plain kernel: the
// packed path must not change which kernel computes the result).
std::optional<at::Tensor> packed_weight(const void* data, size_t bytes, const at::Tensor& w, const at::Tensor& x,
                                        const std::optional<at::Tensor>& b, ffi::Span<const int64_t> stride,
                                        ffi::Span<const int64_t> padding, ffi::Span<const int64_t> dilation,
                                        int64_t groups) {
  if (pinned_count.load(std::memory_order_relaxed) == 0 || !packing.load(std::memory_order_relaxed))
    return std::nullopt;
  auto key = pack_key(w, x, stride, padding, dilation, groups);
  std::lock_guard<std::mutex> lock(pinned_mu);
  auto it = pinned.find(data);
  if (it == pinned.end() || it->second.bytes != bytes) return std::nullopt;
  auto& packs = it->second.packs;
  for (const Pack& p : packs)
    if (p.key == key) return p.weight.defined() ? std::optional<at::Tensor>(p.weight) : std::nullopt;
  if (packs.size() >= kMaxPacksPerWeight) return std::nullopt;
  at::Tensor weight;
  try {
    std::vector<int64_t> no_padding(padding.size(), 0);
    // A widened convolution's bf16/float16 weight is converted to x's float32 once, here.
    const at::Tensor wx = w.scalar_type() == x.scalar_type() ? w : w.to(x.scalar_type());
    auto backend = at::native::select_conv_backend(
        x, wx, b, c10::fromIntArrayRefSlow(ints(stride)), c10::fromIntArrayRefSlow(ints(padding)),
        c10::fromIntArrayRefSlow(ints(dilation)), false, c10::fromIntArrayRefSlow(no_padding), c10::SymInt(groups),
        std::nullopt);
    if (backend == at::native::ConvBackend::Mkldnn)
      weight = at::mkldnn_reorder_conv2d_weight(wx.to_mkldnn(), ints(padding), ints(stride), ints(dilation), groups,
                                                x.sizes());
    if (weight.defined()) packs_made.fetch_add(1, std::memory_order_relaxed);
  } catch (const std::exception&) {
    // No packed path for this weight and shape (say, bf16 where oneDNN lacks the instructions).
  }
  packs.push_back({std::move(key), weight});
  return weight.defined() ? std::optional<at::Tensor>(weight) : std::nullopt;
}

// The packed path cannot run this shape after all: later calls take the plain path.
void drop_pack(const void* data, const std::vector<int64_t>& key) {
  std::lock_guard<std::mutex> lock(pinned_mu);
  auto it = pinned.find(data);
  if (it == pinned.end()) return;
  for (Pack& p : it->second.packs)
    if (p.key == key) p.weight = at::Tensor();
}

// The arguments both packed-convolution ops take after their tensor(s): X, W, B, padding, stride,
// dilation, groups.
void push_convolution_args(std::vector<c10::IValue>& stack, const at::Tensor& x, const at::Tensor& w,
                           const std::optional<at::Tensor>& b, ffi::Span<const int64_t> stride,
                           ffi::Span<const int64_t> padding, ffi::Span<const int64_t> dilation, int64_t groups) {
  stack.emplace_back(x);
  stack.emplace_back(w);
  stack.emplace_back(b ? c10::IValue(*b) : c10::IValue());
  stack.emplace_back(ints(padding));
  stack.emplace_back(ints(stride));
  stack.emplace_back(ints(dilation));
  stack.emplace_back(groups);
}

// torch's convolution on a packed weight, through the dispatcher (the op has no C++ header).
at::Tensor packed_convolution(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b,
                              ffi::Span<const int64_t> stride, ffi::Span<const int64_t> padding,
                              ffi::Span<const int64_t> dilation, int64_t groups) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_convolution_pointwise", "");
  std::vector<c10::IValue> stack;
  stack.reserve(10);
  push_convolution_args(stack, x, w, b, stride, padding, dilation, groups);
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// The same convolution written into `out` (XLA's result buffer), not into a tensor torch
// allocates and the handler then copies: `out` is zeroed and the in-place variant of the op adds
// the convolution to it, as a oneDNN binary post-op (conv + 0: the plain result; -0.0 becomes
// +0.0). Zeroing writes the buffer once; the copy read a whole result back and wrote it again:
// a 3 -> 16 3x3 convolution of 16 x 64 x 64, 1.75 against 2.18 ms on one core
// (docs/benchmarks.md, "Convolutions written where XLA wants them"). Returns whether the op wrote
// into `out` itself (else its result was copied there).
bool packed_convolution_into(const at::Tensor& out, const at::Tensor& x, const at::Tensor& w,
                             const std::optional<at::Tensor>& b, ffi::Span<const int64_t> stride,
                             ffi::Span<const int64_t> padding, ffi::Span<const int64_t> dilation, int64_t groups) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_convolution_pointwise_", "binary");
  std::vector<c10::IValue> stack;
  stack.reserve(13);
  stack.emplace_back(out);
  push_convolution_args(stack, x, w, b, stride, padding, dilation, groups);
  stack.emplace_back(std::string("add"));
  stack.emplace_back(at::Scalar(1.0));
  stack.emplace_back(c10::IValue());
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  out.zero_();
  op.callBoxed(&stack);
  const at::Tensor& result = stack[0].toTensor();
  if (result.data_ptr() == out.data_ptr()) return true;
  out.copy_(result);
  return false;
}

// `channels_last`: x, w and the result are laid out [N, *spatial, C] / [O, *kernel, I].
// `has_bias`: `bias` is the convolution's bias, added inside torch's kernel before its one
// rounding, as eager does (else a placeholder that is not read).
// A float32 x with a bf16 or float16 w is a widened convolution (lowering/nn.py): w is converted
// to float32 (exactly) once per call, or once per pack where it is pinned, so that a pinned
// weight keeps its own dtype's buffer and the float32 copy lives only in the pack.
ffi::Error Convolution(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer bias,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> stride,
                       ffi::Span<const int64_t> padding, ffi::Span<const int64_t> dilation,
                       int64_t transposed, ffi::Span<const int64_t> output_padding, int64_t groups,
                       int64_t last, int64_t has_bias) {
  auto dtype = torch_dtype(x.element_type()), wdtype = torch_dtype(w.element_type());
  bool widened = dtype == at::kFloat && (wdtype == at::kBFloat16 || wdtype == at::kHalf);
  if (!dtype || !wdtype || (x.element_type() != w.element_type() && !widened) ||
      out->element_type() != x.element_type() || (has_bias && bias.element_type() != x.element_type()))
    return ffi::Error::InvalidArgument("fx2xla_torch_convolution: unsupported dtypes");
  return guarded("torch convolution", [&] {
    at::Tensor xt = as_tensor(x, *dtype), wt = as_tensor(w, *wdtype), ot = as_tensor(*out, *dtype);
    if (last) xt = channels_last(xt), wt = channels_last(wt), ot = channels_last(ot);
    std::optional<at::Tensor> b;
    if (has_bias) b = as_tensor(bias, *dtype);
    // The plain path's weight in x's dtype: converted at most once per call, by the first slice
    // that needs it (slices run on several threads).
    std::once_flag converted;
    at::Tensor plain_w = widened ? at::Tensor() : wt;
    auto plain_weight = [&]() -> const at::Tensor& {
      if (widened) std::call_once(converted, [&] { plain_w = wt.to(at::kFloat); });
      return plain_w;
    };
    // 2-d, not transposed, float32 or bf16: what oneDNN's packed path takes.
    bool packable = !transposed && xt.dim() == 4 && (*dtype == at::kFloat || *dtype == at::kBFloat16);
    auto conv = [&](const at::Tensor& xs, const at::Tensor& os) {
      if (packable) {
        if (auto pw = packed_weight(w.untyped_data(), w.size_bytes(), wt, xs, b, stride, padding, dilation, groups)) {
          try {
            bool done = false, wrote = false;
            if (in_place.load(std::memory_order_relaxed)) {
              try {
                wrote = packed_convolution_into(os, xs, *pw, b, stride, padding, dilation, groups);
                done = true;
              } catch (const std::exception&) {
                // The copying call below: whether it fails too decides whether the pack is dropped.
              }
            }
            if (!done) os.copy_(packed_convolution(xs, *pw, b, stride, padding, dilation, groups));
            if (wrote) written_in_place.fetch_add(1, std::memory_order_relaxed);
            packed_calls.fetch_add(1, std::memory_order_relaxed);
            return;
          } catch (const std::exception&) {
            drop_pack(w.untyped_data(), pack_key(wt, xs, stride, padding, dilation, groups));
          }
        }
      }
      os.copy_(at::convolution(xs, plain_weight(), b, ints(stride), ints(padding), ints(dilation), transposed != 0,
                               ints(output_padding), groups));
    };
    if (run_served([&] { conv(xt, ot); })) return;
    int64_t n = xt.size(0), parts = slices(n, pool);
    if (parts == 1) return conv(xt, ot);
    run_split(parts, pool, [&](int64_t i) {
      auto [lo, hi] = slice_bounds(i, n, parts);
      conv(xt.slice(0, lo, hi), ot.slice(0, lo, hi));
    });
  });
}

ffi::Error ConvolutionBackward(ffi::ThreadPool pool, ffi::AnyBuffer grad, ffi::AnyBuffer x, ffi::AnyBuffer w,
                               ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::AnyBuffer> dw,
                               ffi::Span<const int64_t> stride, ffi::Span<const int64_t> padding,
                               ffi::Span<const int64_t> dilation, int64_t transposed,
                               ffi::Span<const int64_t> output_padding, int64_t groups,
                               int64_t input_mask, int64_t weight_mask, int64_t last) {
  auto dtype = torch_dtype(x.element_type());
  if (!dtype || x.element_type() != w.element_type() || grad.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("fx2xla_torch_convolution_backward: unsupported dtypes");
  return guarded("torch convolution_backward", [&] {
    at::Tensor gt = as_tensor(grad, *dtype), xt = as_tensor(x, *dtype), wt = as_tensor(w, *dtype);
    at::Tensor dxt = as_tensor(*dx, *dtype), dwt = as_tensor(*dw, *dtype);
    if (last) {
      gt = channels_last(gt), xt = channels_last(xt), wt = channels_last(wt);
      dxt = channels_last(dxt), dwt = channels_last(dwt);
    }
    // Per slice: its input gradient into place, its weight gradient kept; the weight gradient is
    // their sum, in slice order (deterministic), accumulated in float32 for half types.
    auto backward = [&](const at::Tensor& gs, const at::Tensor& xs) {
      auto [gx, gw, gb] = at::convolution_backward(
          gs, xs, wt, std::nullopt, ints(stride), ints(padding), ints(dilation), transposed != 0,
          ints(output_padding), groups, {input_mask != 0, weight_mask != 0, false});
      return std::make_pair(gx, gw);
    };
    auto whole = [&] {
      auto [gx, gw] = backward(gt, xt);
      if (input_mask) dxt.copy_(gx);
      if (weight_mask) dwt.copy_(gw);
    };
    if (run_served(whole)) return;
    int64_t n = xt.size(0), parts = slices(n, pool);
    if (parts == 1) return whole();
    std::vector<at::Tensor> weight_grads(parts);
    run_split(parts, pool, [&](int64_t i) {
      auto [lo, hi] = slice_bounds(i, n, parts);
      auto [gx, gw] = backward(gt.slice(0, lo, hi), xt.slice(0, lo, hi));
      if (input_mask) dxt.slice(0, lo, hi).copy_(gx);
      if (weight_mask) weight_grads[i] = gw;
    });
    if (weight_mask) {
      bool half = *dtype == at::kHalf || *dtype == at::kBFloat16;
      at::Tensor total = weight_grads[0].to(half ? at::kFloat : *dtype, /*non_blocking=*/false, /*copy=*/true);
      for (int64_t i = 1; i < parts; ++i) total.add_(weight_grads[i]);
      dwt.copy_(total);
    }
  });
}


// ---------------------------------------------------------------------------------------------
// Attention: torch's CPU flash-attention kernel (at::_scaled_dot_product_flash_attention_for_cpu,
// the kernel eager and Inductor run) on XLA's buffers. XLA:CPU computes attention as two batched
// dots around a softmax, whose small per-head GEMMs run at a fraction of its large ones' rate:
// BERT's attention at 4 x 128 took 2.1 ms a layer against the kernel's 0.84 ms (docs/
// benchmarks.md, "torch's attention inside the executable").
//
// q [B, H, L, E], k [B, KV, S, E], v [B, KV, S, Ev] with H = KV * g: kv head j serves query heads
// [j g, (j + 1) g), as torch's enable_gqa pairs them. Each operand and the output is laid out
// either as that shape ("head-major") or as [B, L, H, E] ("sequence-major", what a projection
// followed by a view writes; `*_seq` attributes), and is viewed here with the strides of the
// other so that no operand is transposed. `mask` (when `has_mask`) is an additive mask of rank 4
// broadcastable to [B, H, L, S]. `lse`, float32 [B, H, L] or empty, receives the kernel's
// logsumexp.
//
// Work is cut across XLA's intra-op threads into slices of the batch, or where the batch is
// smaller than the thread count, of the kv heads; each slice runs the kernel single-threaded.
// Every (batch, head) pair's result is the kernel's, bit for bit the whole call's: the kernel
// computes each pair on its own, with blocking that depends on L and S only. A kv head shared by
// several query heads is passed to the kernel as a stride-0 view of its g copies.

std::atomic<int64_t> attention_calls{0};  // fx2xla_torch_attention_calls

// Below this many multiply-adds (B H L S (E + Ev)), one thread runs the whole call: waking another
// would cost about what its share saves (a decode step's attention).
constexpr int64_t kAttentionSplitMacs = 1 << 20;

at::Tensor head_major(at::Tensor t, int64_t seq) { return seq ? t.transpose(1, 2) : t; }

ffi::Error Attention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer mask,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse, int64_t q_seq, int64_t k_seq,
                     int64_t v_seq, int64_t out_seq, int64_t has_mask, int64_t is_causal, double scale) {
  auto dtype = torch_dtype(q.element_type());
  if (!dtype || k.element_type() != q.element_type() || v.element_type() != q.element_type() ||
      out->element_type() != q.element_type() || lse->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("fx2xla_torch_attention: unsupported dtypes");
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 || v.dimensions().size() != 4 ||
      out->dimensions().size() != 4 || (has_mask && mask.dimensions().size() != 4))
    return ffi::Error::InvalidArgument("fx2xla_torch_attention: operands must have rank 4");
  auto mask_dtype = has_mask ? torch_dtype(mask.element_type()) : dtype;
  if (!mask_dtype) return ffi::Error::InvalidArgument("fx2xla_torch_attention: unsupported mask dtype");
  return guarded("torch attention", [&] {
    at::Tensor qt = head_major(as_tensor(q, *dtype), q_seq), kt = head_major(as_tensor(k, *dtype), k_seq);
    at::Tensor vt = head_major(as_tensor(v, *dtype), v_seq), ot = head_major(as_tensor(*out, *dtype), out_seq);
    std::optional<at::Tensor> mt;
    if (has_mask) mt = as_tensor(mask, *mask_dtype);
    bool want_lse = lse->element_count() > 0;
    at::Tensor lt = want_lse ? as_tensor(*lse, at::kFloat) : at::Tensor();
    int64_t b = qt.size(0), heads = qt.size(1), kv = kt.size(1);
    TORCH_CHECK(kv > 0 && heads % kv == 0 && vt.size(1) == kv && kt.size(0) == b && vt.size(0) == b,
                "query heads ", heads, " and kv heads ", kv, " do not pair");
    int64_t g = heads / kv;
    // NaN: the kernel's default, 1 / sqrt(E), computed as eager computes it.
    std::optional<double> opt_scale = std::isnan(scale) ? std::nullopt : std::optional<double>(scale);
    // One kernel call: batch [b0, b1), kv heads [j0, j1).
    auto run = [&](int64_t b0, int64_t b1, int64_t j0, int64_t j1) {
      auto part = [&](const at::Tensor& t, int64_t h0, int64_t h1) {
        return t.slice(0, b0, b1).slice(1, h0, h1);
      };
      auto part_mask = [&](int64_t h0, int64_t h1) -> std::optional<at::Tensor> {
        if (!mt) return std::nullopt;
        at::Tensor m = *mt;
        if (m.size(0) > 1) m = m.slice(0, b0, b1);
        if (m.size(1) > 1) m = m.slice(1, h0, h1);
        return m;
      };
      // Without grouping, one call takes the kv heads' range; with it, one call per kv head, its
      // K and V repeated g times as a stride-0 view.
      int64_t step = g == 1 ? j1 - j0 : 1;
      for (int64_t j = j0; j < j1; j += step) {
        int64_t h0 = j * g, h1 = (j + step) * g;
        at::Tensor ks = part(kt, j, j + step), vs = part(vt, j, j + step);
        if (g > 1) {
          ks = ks.expand({b1 - b0, g, ks.size(2), ks.size(3)});
          vs = vs.expand({b1 - b0, g, vs.size(2), vs.size(3)});
        }
        auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(part(qt, h0, h1), ks, vs, 0.0, is_causal != 0,
                                                                     part_mask(h0, h1), opt_scale);
        part(ot, h0, h1).copy_(o);
        if (want_lse) part(lt, h0, h1).copy_(l);
      }
    };
    attention_calls.fetch_add(1, std::memory_order_relaxed);
    int64_t macs = b * heads * qt.size(2) * kt.size(2) * (qt.size(3) + vt.size(3));
    int64_t threads = std::min(pool.num_threads(), usable_cores());
    // Slices of the batch where it has a sample per thread, else of the kv heads.
    bool by_batch = b >= threads;
    int64_t n = by_batch ? b : kv;
    int64_t parts = slicing.load(std::memory_order_relaxed) && macs >= kAttentionSplitMacs && threads > 1
                        ? std::min(threads, n) : 1;
    if (parts == 1) {
      SingleThreaded one;
      return run(0, b, 0, kv);
    }
    run_split(parts, pool, [&](int64_t i) {
      auto [lo, hi] = slice_bounds(i, n, parts);
      if (by_batch)
        run(lo, hi, 0, kv);
      else
        run(0, b, lo, hi);
    });
  });
}

// Runs cols(lo, hi) over columns [0, n) of a matmul's output (or any n independent units of work):
// whole, on the calling thread, where the work's size (`bytes` of W, or another measure) is below
// `split_bytes` or one thread is usable; else cut into `per_thread` chunks per thread, of whole
// `group`-column groups, which the caller and pool tasks claim in turn: one task per chunk past
// the first, or with `one_helper_per_core` one per usable core past the caller's. An exception
// becomes an error naming `kernel`.
ffi::Error split_columns(ffi::ThreadPool& pool, int64_t n, int64_t bytes, int64_t split_bytes, int64_t group,
                         int64_t per_thread, bool one_helper_per_core, const char* kernel,
                         const std::function<void(int64_t, int64_t)>& cols) {
  int64_t threads = std::min(pool.num_threads(), usable_cores());
  int64_t groups = (n + group - 1) / group, parts = std::min(per_thread * threads, groups);
  if (threads < 2 || bytes < split_bytes || parts < 2) {
    cols(0, n);
    return ffi::Error::Success();
  }
  try {
    run_split(parts, pool, [&](int64_t i) {
      auto [lo, hi] = slice_bounds(i, groups, parts);
      cols(lo * group, std::min(hi * group, n));
    }, /*calls_torch=*/false, one_helper_per_core ? threads - 1 : -1);
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string(kernel) + ": " + e.what());
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Skinny matmuls: y[M, N] = x[M, K] . W accumulated in float32, x and W in bfloat16, for one
// row (a decode step at batch 1). Its cost is reading W once. XLA:CPU's bf16 dot of one row
// converts W to float32 in a pass of its own and then takes a slow path (fx2xla/torch_kernels.py
// gives the figures; from two rows on it is fast). Here W is read once and converted in
// registers, and a large W is cut into chunks that XLA's intra-op threads and the calling thread
// read at once. More rows are computed one at a time, each reading W again.

std::atomic<int64_t> skinny_calls{0};  // fx2xla_skinny_matmul_calls

// GCC vector extensions: 16 float lanes (one zmm with AVX-512, two ymm with AVX2, four xmm else).
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads and stores
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x8u __attribute__((vector_size(32), aligned(4)));  // unaligned loads and stores
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint16_t u16x16u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline float as_f32(uint16_t bf16) {  // bfloat16 bits: the high half of a float32's
  uint32_t u = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// 16 bfloat16 values from p (any alignment) as float32 lanes.
inline __attribute__((always_inline)) f32x16 load16(const uint16_t* p) {
  u32x16 wide = __builtin_convertvector(static_cast<u16x16>(*reinterpret_cast<const u16x16u*>(p)), u32x16) << 16;
  return reinterpret_cast<f32x16>(wide);
}

inline __attribute__((always_inline)) f32x4 fold4(f32x16 v) {  // lanes 0-3 hold v's sum in four parts
  f32x8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
}

inline __attribute__((always_inline)) f32x4 fold4(f32x8 v) {  // 8 lanes: AVX2's registers
  return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
}

// The lane sums of a, b, c and d, as lanes 0-3: four rows' dot products reduced together (8- or
// 16-lane vectors).
template <typename V>
inline __attribute__((always_inline)) f32x4 hsum4(V a, V b, V c, V d) {
  f32x4 fa = fold4(a), fb = fold4(b), fc = fold4(c), fd = fold4(d);
  f32x4 ab = __builtin_shufflevector(fa, fb, 0, 4, 1, 5) + __builtin_shufflevector(fa, fb, 2, 6, 3, 7);
  f32x4 cd = __builtin_shufflevector(fc, fd, 0, 4, 1, 5) + __builtin_shufflevector(fc, fd, 2, 6, 3, 7);
  return __builtin_shufflevector(ab, cd, 0, 1, 4, 5) + __builtin_shufflevector(ab, cd, 2, 3, 6, 7);
}

// W laid out [N, K] (x . W^T: nn.Linear's weight): y[j, j + R) of one row x, from R rows of W,
// each with its own accumulator.
template <int R>
inline __attribute__((always_inline)) void nt_tile(const float* x, const uint16_t* w, float* y, int64_t k,
                                                   int64_t j) {
  f32x16 acc[R] = {};
  int64_t t = 0;
  for (; t + 16 <= k; t += 16) {
    f32x16 xv = *reinterpret_cast<const f32x16u*>(x + t);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] += xv * load16(w + (j + r) * k + t);
  }
  float sums[R];
  if constexpr (R == 4) {
    f32x4 s4 = hsum4(acc[0], acc[1], acc[2], acc[3]);
    for (int r = 0; r < 4; ++r) sums[r] = s4[r];
  } else {
    f32x4 s = fold4(acc[0]);
    sums[0] = s[0] + s[1] + s[2] + s[3];
  }
  for (int r = 0; r < R; ++r) {
    for (int64_t u = t; u < k; ++u) sums[r] += x[u] * as_f32(w[(j + r) * k + u]);
    y[j + r] = sums[r];
  }
}

inline __attribute__((always_inline)) void skinny_nt(const float* x, const uint16_t* w, float* y, int64_t k,
                                                     int64_t lo, int64_t hi) {
  int64_t j = lo;
  for (; j + 4 <= hi; j += 4) nt_tile<4>(x, w, y, k, j);
  for (; j < hi; ++j) nt_tile<1>(x, w, y, k, j);
}

// W laid out [K, N] (x . W: GPT-2's Conv1D weight): y[j, j + 16C) of one row x, from a panel of
// 16C columns of W read row by row.
template <int C>
inline __attribute__((always_inline)) void nn_tile(const float* x, const uint16_t* w, float* y, int64_t k,
                                                   int64_t n, int64_t j) {
  f32x16 acc[C] = {};
  for (int64_t t = 0; t < k; ++t) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) acc[c] += x[t] * load16(w + t * n + j + 16 * c);
  }
  for (int c = 0; c < C; ++c) *reinterpret_cast<f32x16u*>(y + j + 16 * c) = acc[c];
}

inline __attribute__((always_inline)) void skinny_nn(const float* x, const uint16_t* w, float* y, int64_t k,
                                                     int64_t n, int64_t lo, int64_t hi) {
  int64_t j = lo;
  for (; j + 64 <= hi; j += 64) nn_tile<4>(x, w, y, k, n, j);
  for (; j + 16 <= hi; j += 16) nn_tile<1>(x, w, y, k, n, j);
  for (; j < hi; ++j) {
    float s = 0;
    for (int64_t t = 0; t < k; ++t) s += x[t] * as_f32(w[t * n + j]);
    y[j] = s;
  }
}

// Compiled once per instruction set and picked at load time (the library is built where it
// runs, but a build folder may be shared across machines); everything above is inlined into it.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FX2XLA_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define FX2XLA_CLONES
#endif

// One row x (float32) against W, for y's columns [lo, hi).
FX2XLA_CLONES void skinny_row(const float* x, const uint16_t* w, float* y, int64_t k, int64_t n, int64_t lo,
                              int64_t hi, bool w_nk) {
  if (w_nk)
    skinny_nt(x, w, y, k, lo, hi);
  else
    skinny_nn(x, w, y, k, n, lo, hi);
}

// Below this many bytes of W, one thread reads it: waking another (tens of µs on a busy
// machine) would cost about what its share saves.
constexpr int64_t kSkinnySplitBytes = 512 << 10;

// `w_nk`: W is laid out [N, K], else [K, N]. x and W are bfloat16, y float32.
ffi::Error SkinnyMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Result<ffi::AnyBuffer> y, int64_t w_nk) {
  auto type = x.element_type();
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (type != ffi::DataType::BF16 || w.element_type() != type || y->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("fx2xla_skinny_matmul: x and W must be bfloat16, y float32");
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("fx2xla_skinny_matmul: x, W and y must be matrices");
  int64_t m = xd[0], k = xd[1], n = w_nk ? wd[0] : wd[1];
  if ((w_nk ? wd[1] : wd[0]) != k || yd[0] != m || yd[1] != n)
    return ffi::Error::InvalidArgument("fx2xla_skinny_matmul: shapes do not chain");
  skinny_calls.fetch_add(1, std::memory_order_relaxed);
  float* out = static_cast<float*>(y->untyped_data());
  // x (a few rows) in float32 once, for every chunk: the kernels convert only W as they read it.
  static thread_local std::vector<float> x32;
  x32.resize(m * k);
  auto xb = static_cast<const uint16_t*>(x.untyped_data());
  for (int64_t i = 0; i < m * k; ++i) x32[i] = as_f32(xb[i]);
  const float* xs = x32.data();
  auto ws = static_cast<const uint16_t*>(w.untyped_data());
  auto cols = [&](int64_t lo, int64_t hi) {
    for (int64_t i = 0; i < m; ++i) skinny_row(xs + i * k, ws, out + i * n, k, n, lo, hi, w_nk != 0);
  };
  // Two chunks per thread, of whole 16-column groups: a thread that wakes late still gets work.
  return split_columns(pool, n, n * k * 2, kSkinnySplitBytes, 16, 2, /*one_helper_per_core=*/false,
                       "fx2xla_skinny_matmul", cols);
}

// ---------------------------------------------------------------------------------------------
// Few-row float32 matmuls: y[M, N] = x[M, K] . W^T with W laid out [N, K], as nn.Linear holds
// it, for the 2-8 rows of a decode step at a small batch (lowering/linalg.py: FEW_ROWS). Its cost
// is reading W once, from L3 or memory, and the multiply-adds. A tile of C rows of W is read in
// chunks of 16 floats (AVX-512; 8 on other CPUs), each multiplied into every row of x (a few KiB,
// which stays in L1): one accumulator per (row of x, row of W), reduced four at a time across
// lanes at the end of the tile. C is as large as the CPU's vector registers allow (few_rows). The
// next tile's rows are read into the caches while this one runs. On an Ice Lake, one row of W at
// a time against 8-float chunks of x, with W read ahead through prefetchnta (which skips the
// outer caches), took 1.5-2x the time of the tiles; the hardware's prefetcher alone left the
// tiles waiting on W (docs/benchmarks.md, "Few-row matmuls in tiles"). Rows of x beyond 8 are
// taken 8 at a time against the same tile, then in L1. Columns are cut into chunks for XLA's
// intra-op threads as the skinny kernel's are.

std::atomic<int64_t> few_rows_calls{0};  // fx2xla_few_rows_matmul_calls

// Multiply-adds are fused (vfmadd) as MKL's are: the library is built in ISO C++ mode, which
// otherwise keeps them as separate multiplies and adds.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

template <typename V>
inline __attribute__((always_inline)) V load_lanes(const float* p) {  // any alignment
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// y[i, j + c] = x[i, :] . W[j + c, :] for the R rows i of x (row stride k) and the C rows j + c
// of W (y's row stride n), in chunks of V's lanes. `ahead`: read the next tile's rows of W into
// the caches.
template <typename V, int R, int C>
inline __attribute__((always_inline)) void few_rows_tile(const float* x, const float* w, float* y, int64_t k,
                                                         int64_t n, int64_t j, bool ahead) {
  constexpr int kLanes = sizeof(V) / sizeof(float), kPadded = (R * C + 3) / 4 * 4;
  V acc[kPadded] = {};
  const float* wj = w + j * k;
  int64_t t = 0;
  for (; t + kLanes <= k; t += kLanes) {
    V wv[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      wv[c] = load_lanes<V>(wj + c * k + t);
      if (ahead) __builtin_prefetch(wj + (c + C) * k + t, 0, 3);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      V xv = load_lanes<V>(x + r * k + t);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r * C + c] += xv * wv[c];
    }
  }
  float sums[kPadded];
#pragma GCC unroll 8
  for (int a = 0; a < kPadded; a += 4) {
    f32x4 s4 = hsum4(acc[a], acc[a + 1], acc[a + 2], acc[a + 3]);
    for (int b = 0; b < 4; ++b) sums[a + b] = s4[b];
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float v = sums[r * C + c];
      for (int64_t u = t; u < k; ++u) v += x[r * k + u] * wj[c * k + u];
      y[r * n + j + c] = v;
    }
}

// Rows [0, m) of y, columns [j, j + C): rows of x 8 at a time against the same C rows of W (only
// the first 8 read ahead).
template <typename V, int C>
inline __attribute__((always_inline)) void few_rows_columns(const float* x, const float* w, float* y, int64_t m,
                                                            int64_t k, int64_t n, int64_t j, bool ahead) {
  for (int64_t i = 0; i < m; i += 8) {
    const float* xi = x + i * k;
    float* yi = y + i * n;
    bool first = ahead && i == 0;
    switch (std::min<int64_t>(m - i, 8)) {
      case 8: few_rows_tile<V, 8, C>(xi, w, yi, k, n, j, first); break;
      case 7: few_rows_tile<V, 7, C>(xi, w, yi, k, n, j, first); break;
      case 6: few_rows_tile<V, 6, C>(xi, w, yi, k, n, j, first); break;
      case 5: few_rows_tile<V, 5, C>(xi, w, yi, k, n, j, first); break;
      case 4: few_rows_tile<V, 4, C>(xi, w, yi, k, n, j, first); break;
      case 3: few_rows_tile<V, 3, C>(xi, w, yi, k, n, j, first); break;
      case 2: few_rows_tile<V, 2, C>(xi, w, yi, k, n, j, first); break;
      default: few_rows_tile<V, 1, C>(xi, w, yi, k, n, j, first); break;
    }
  }
}

// Columns [lo, hi) in tiles of C rows of W, the last few one row at a time.
template <typename V, int C>
inline __attribute__((always_inline)) void few_rows_tiles(const float* x, const float* w, float* y, int64_t m,
                                                          int64_t k, int64_t n, int64_t lo, int64_t hi) {
  int64_t j = lo;
  for (; j + C <= hi; j += C) few_rows_columns<V, C>(x, w, y, m, k, n, j, j + 2 * C <= hi);
  for (; j < hi; ++j) few_rows_columns<V, 1>(x, w, y, m, k, n, j, false);
}

// Rows [0, m) of y, columns [lo, hi). `wide`: 16-lane accumulators, for CPUs with AVX-512's 32
// vector registers (tiles of up to 8 x 2 or 4 x 4 accumulators); else 8 lanes, with AVX2's 16
// registers in mind (tiles of up to 8 accumulators: 2 x 4, 4 x 2, 8 x 1).
FX2XLA_CLONES void few_rows(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n,
                            int64_t lo, int64_t hi, bool wide) {
  if (wide) {
    if (m <= 4)
      few_rows_tiles<f32x16, 4>(x, w, y, m, k, n, lo, hi);
    else
      few_rows_tiles<f32x16, 2>(x, w, y, m, k, n, lo, hi);
  } else if (m <= 2) {
    few_rows_tiles<f32x8, 4>(x, w, y, m, k, n, lo, hi);
  } else if (m <= 4) {
    few_rows_tiles<f32x8, 2>(x, w, y, m, k, n, lo, hi);
  } else {
    few_rows_tiles<f32x8, 1>(x, w, y, m, k, n, lo, hi);
  }
}

// Whether the few-row kernel uses 16-lane accumulators: where the CPU has AVX-512, unless
// FX2XLA_FEW_ROWS_LANES=8 asks for the 8-lane tiles (AVX2's, which tests run on any CPU).
bool few_rows_wide() {
  static const bool wide = [] {
    const char* lanes = std::getenv("FX2XLA_FEW_ROWS_LANES");
    if (lanes && std::string_view(lanes) == "8") return false;
#if defined(__x86_64__) && defined(__GNUC__)
    return __builtin_cpu_supports("avx512f") != 0;
#else
    return false;
#endif
  }();
  return wide;
}

#pragma GCC pop_options

// Below this many bytes of W, one thread reads it (as kSkinnySplitBytes; at 128 KiB, a decode
// step at 8 rows was slower than at 512).
constexpr int64_t kFewRowsSplitBytes = 512 << 10;

ffi::Error FewRowsMatmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (x.element_type() != ffi::DataType::F32 || w.element_type() != ffi::DataType::F32 ||
      y->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("fx2xla_few_rows_matmul: x, W and y must be float32");
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2)
    return ffi::Error::InvalidArgument("fx2xla_few_rows_matmul: x, W and y must be matrices");
  int64_t m = xd[0], k = xd[1], n = wd[0];
  if (wd[1] != k || yd[0] != m || yd[1] != n)
    return ffi::Error::InvalidArgument("fx2xla_few_rows_matmul: shapes do not chain");
  few_rows_calls.fetch_add(1, std::memory_order_relaxed);
  auto xs = static_cast<const float*>(x.untyped_data());
  auto ws = static_cast<const float*>(w.untyped_data());
  float* out = static_cast<float*>(y->untyped_data());
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(out, out + m * n, 0.0f);
    return ffi::Error::Success();
  }
  // Four chunks per thread, of whole 8-column groups: the threads' shares of W come from L3 or
  // memory at rates that vary, and a thread that finishes early takes another chunk (a LLaMA
  // 4L decode step at 8 rows was a little faster so than with two chunks per thread, ad hoc).
  // One worker per core, the caller included: more would share the cores (the caller is often
  // not one of the pool's threads) and interleave their streams of W.
  return split_columns(pool, n, n * k * 4, kFewRowsSplitBytes, 8, 4, /*one_helper_per_core=*/true,
                       "fx2xla_few_rows_matmul",
                       [&, wide = few_rows_wide()](int64_t lo, int64_t hi) {
                         few_rows(xs, ws, out, m, k, n, lo, hi, wide);
                       });
}

// ---------------------------------------------------------------------------------------------
// torch's matmul: c[M, N] = op(a) . op(b) in float32 or float64, op a transpose or none, through
// at::mm (MKL's gemm on x86, the kernel eager and Inductor call). XLA:CPU's dot of the shapes a
// training step multiplies (32 x 1024 . 1024 x 4096, and its backward's transposed products)
// took 1.7-2.2x this kernel's time on an Ice Lake (docs/benchmarks.md, "torch's matmuls in
// training graphs"). Columns of c (and b) are cut into one slice per usable thread of XLA's pool,
// each a single-threaded gemm on its own thread (no OpenMP or MKL team started from XLA's
// threads: see "Batch splitting"), written in place: a column slice of a row-major matrix is a
// matrix with a leading dimension, which MKL takes as it is. Where the main thread serves (see
// "Serving"), the product runs there whole, on torch's team: eager's own call.

std::atomic<int64_t> matmul_calls{0};  // fx2xla_torch_matmul_calls

// Below this many multiply-adds, one thread computes the product (a slice's gemm would take
// less time than handing it to another thread).
constexpr int64_t kMatmulSplitMacs = 1 << 20;
// Slices hold whole groups of this many columns (one AVX-512 register of floats).
constexpr int64_t kMatmulColumnGroup = 16;

// c = a . b (2-D views): served whole where the main thread serves, else its columns cut across
// XLA's threads, each slice a single-threaded gemm.
void torch_mm_into(ffi::ThreadPool& pool, at::Tensor& ct, const at::Tensor& at_, const at::Tensor& bt) {
  int64_t m = at_.size(0), k = at_.size(1), n = bt.size(1);
  if (m == 0 || n == 0) return;
  if (run_served([&] { at::mm_out(ct, at_, bt); })) return;
  int64_t threads = std::min(pool.num_threads(), usable_cores());
  int64_t groups = (n + kMatmulColumnGroup - 1) / kMatmulColumnGroup;
  int64_t parts = m * n * k >= kMatmulSplitMacs ? std::min(threads, groups) : 1;
  if (parts <= 1) {
    SingleThreaded one;
    at::mm_out(ct, at_, bt);
    return;
  }
  run_split(parts, pool, [&](int64_t i) {
    auto [lo, hi] = slice_bounds(i, groups, parts);
    lo *= kMatmulColumnGroup, hi = std::min(hi * kMatmulColumnGroup, n);
    at::Tensor cs = ct.slice(1, lo, hi);
    at::mm_out(cs, at_, bt.slice(1, lo, hi));
  });
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> c,
                  int64_t transpose_a, int64_t transpose_b) {
  auto dtype = torch_dtype(a.element_type());
  if (!dtype || (*dtype != at::kFloat && *dtype != at::kDouble) || b.element_type() != a.element_type() ||
      c->element_type() != a.element_type())
    return ffi::Error::InvalidArgument("fx2xla_torch_matmul: a, b and c must be float32 or float64, all one");
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || cd.size() != 2)
    return ffi::Error::InvalidArgument("fx2xla_torch_matmul: a, b and c must be matrices");
  int64_t m = transpose_a ? ad[1] : ad[0], k = transpose_a ? ad[0] : ad[1];
  int64_t n = transpose_b ? bd[0] : bd[1];
  if ((transpose_b ? bd[1] : bd[0]) != k || cd[0] != m || cd[1] != n)
    return ffi::Error::InvalidArgument("fx2xla_torch_matmul: shapes do not chain");
  matmul_calls.fetch_add(1, std::memory_order_relaxed);
  return guarded("torch matmul", [&] {
    at::Tensor at_ = as_tensor(a, *dtype), bt = as_tensor(b, *dtype), ct = as_tensor(*c, *dtype);
    if (transpose_a) at_ = at_.t();
    if (transpose_b) bt = bt.t();
    torch_mm_into(pool, ct, at_, bt);
  });
}

// torch's matmul of one layer's weight in a folded loop: c[M, N] = a[M, K] . op(stack[index]),
// stack [L, R, C], op a transpose where transpose_b is 1. A loop body that reads its layer's
// weight as a slice of the stacked weights would otherwise copy the slice out on every
// iteration (XLA:CPU's dot takes no dynamic slice in place): at batch 1 x 128 a folded GPT-2
// spent 1.1-1.3x the time of the unrolled one, the copies being the difference
// (docs/benchmarks.md, "Folded layers' weights read in place"). Here the gemm reads the layer's
// weight where it lies. The index is clamped into [0, L) as XLA's dynamic slice clamps it.

std::atomic<int64_t> indexed_matmul_calls{0};  // fx2xla_torch_matmul_indexed_calls

ffi::Error MatmulIndexed(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer stack, ffi::AnyBuffer index,
                         ffi::Result<ffi::AnyBuffer> c, int64_t transpose_b) {
  auto dtype = torch_dtype(a.element_type());
  if (!dtype || (*dtype != at::kFloat && *dtype != at::kDouble) || stack.element_type() != a.element_type() ||
      c->element_type() != a.element_type())
    return ffi::Error::InvalidArgument("fx2xla_torch_matmul_indexed: a, stack and c must be float32 or float64, all one");
  if (index.element_type() != ffi::DataType::S32 || index.element_count() != 1)
    return ffi::Error::InvalidArgument("fx2xla_torch_matmul_indexed: the index must be one int32");
  auto ad = a.dimensions(), sd = stack.dimensions(), cd = c->dimensions();
  if (ad.size() != 2 || sd.size() != 3 || cd.size() != 2 || sd[0] < 1)
    return ffi::Error::InvalidArgument("fx2xla_torch_matmul_indexed: a and c must be matrices, stack a non-empty stack of them");
  int64_t m = ad[0], k = ad[1], n = transpose_b ? sd[1] : sd[2];
  if ((transpose_b ? sd[2] : sd[1]) != k || cd[0] != m || cd[1] != n)
    return ffi::Error::InvalidArgument("fx2xla_torch_matmul_indexed: shapes do not chain");
  int64_t layer = std::clamp<int64_t>(*static_cast<const int32_t*>(index.untyped_data()), 0, sd[0] - 1);
  indexed_matmul_calls.fetch_add(1, std::memory_order_relaxed);
  return guarded("torch matmul (indexed)", [&] {
    at::Tensor bt = as_tensor(stack, *dtype).select(0, layer);
    if (transpose_b) bt = bt.t();
    at::Tensor ct = as_tensor(*c, *dtype);
    torch_mm_into(pool, ct, as_tensor(a, *dtype), bt);
  });
}

// ---------------------------------------------------------------------------------------------
// Decode attention: softmax(q . k^T * scale + mask) . v for a few query rows per kv head (a
// decode step: one new token per sequence, its query heads grouped on each kv head), float32.
// XLA:CPU gives each of these tiny batched dots to YNNPACK, at 75-180 us a dot for a LLaMA 4L
// step at batch 8 (2 x 47 scores per kv head): more than the step's 13 MiB of weights take to
// stream through the few-row kernel, layer for layer. Here each kv head's rows are computed
// together straight from the cache, K and V rows read once for all of them.

std::atomic<int64_t> decode_attention_calls{0};  // fx2xla_decode_attention_calls

#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")

inline float dot_row(const float* a, const float* b, int64_t n) {
  f32x8 acc = {};
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) acc += *reinterpret_cast<const f32x8u*>(a + t) * *reinterpret_cast<const f32x8u*>(b + t);
  float v = 0.0f;
  for (int i = 0; i < 8; ++i) v += acc[i];
  for (; t < n; ++t) v += a[t] * b[t];
  return v;
}

inline void add_scaled(float* acc, const float* v, float p, int64_t n) {
  int64_t t = 0;
  f32x8 pv = {p, p, p, p, p, p, p, p};
  for (; t + 8 <= n; t += 8)
    *reinterpret_cast<f32x8u*>(acc + t) += pv * *reinterpret_cast<const f32x8u*>(v + t);
  for (; t < n; ++t) acc[t] += p * v[t];
}

struct DecodeAttentionShape {
  int64_t b, heads, length, e, kv, s, ev;
  int64_t mask_strides[4];  // per dim of [B, H, L, S]: 0 where the mask broadcasts
  bool has_mask, causal, lse;
  float scale;
};

// The rows of kv head `g` of sample `n`: query heads [g * groups, (g + 1) * groups), every
// position l. A row whose keys are all masked gets 0 and a logsumexp of 0, as torch's kernel.
FX2XLA_CLONES void decode_attention_head(const DecodeAttentionShape& d, const float* q, const float* k,
                                         const float* v, const float* mask, float* out, float* lse,
                                         int64_t n, int64_t g, std::vector<float>& scores) {
  const int64_t groups = d.heads / d.kv, rows = groups * d.length;
  scores.resize(rows * d.s);
  const float* kb = k + (n * d.kv + g) * d.s * d.e;
  const float* vb = v + (n * d.kv + g) * d.s * d.ev;
  const float* qb = q + (n * d.heads + g * groups) * d.length * d.e;  // rows in (head, l) order
  float* ob = out + (n * d.heads + g * groups) * d.length * d.ev;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < d.s; ++s)
    for (int64_t r = 0; r < rows; ++r) scores[r * d.s + s] = dot_row(qb + r * d.e, kb + s * d.e, d.e) * d.scale;
  for (int64_t r = 0; r < rows; ++r) {
    float* sc = scores.data() + r * d.s;
    const int64_t h = g * groups + r / d.length, l = r % d.length;
    if (d.has_mask) {
      const float* mr = mask + n * d.mask_strides[0] + h * d.mask_strides[1] + l * d.mask_strides[2];
      for (int64_t s = 0; s < d.s; ++s) sc[s] += mr[s * d.mask_strides[3]];
    }
    if (d.causal)  // top-left aligned, as torch's is_causal
      for (int64_t s = l + 1; s < d.s; ++s) sc[s] = neg_inf;
    float m = neg_inf;
    for (int64_t s = 0; s < d.s; ++s) m = std::max(m, sc[s]);
    if (m == neg_inf) m = 0.0f;
    float total = 0.0f;
    for (int64_t s = 0; s < d.s; ++s) total += (sc[s] = std::exp(sc[s] - m));
    if (total == 0.0f) total = 1.0f;
    float* o = ob + r * d.ev;
    std::fill(o, o + d.ev, 0.0f);
    for (int64_t s = 0; s < d.s; ++s) add_scaled(o, vb + s * d.ev, sc[s], d.ev);  // masked too: 0 x inf is NaN, as eager's
    const float inv = 1.0f / total;
    for (int64_t t = 0; t < d.ev; ++t) o[t] *= inv;
    if (d.lse) lse[(n * d.heads + h) * d.length + l] = m + std::log(total);
  }
}

#pragma GCC pop_options

// Below this many multiply-adds, one thread computes every kv head (a LLaMA 4L step at batch 8
// has 4 x 47 x 128 per kv head: handing those to a pool thread costs more than they take).
constexpr int64_t kDecodeAttentionSplitMacs = 1 << 20;

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer mask, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> lse,
                           int64_t has_mask, int64_t is_causal, double scale) {
  const char* name = "fx2xla_decode_attention";
  for (auto t : {q.element_type(), k.element_type(), v.element_type(), mask.element_type(), out->element_type(),
                 lse->element_type()})
    if (t != ffi::DataType::F32) return ffi::Error::InvalidArgument(std::string(name) + ": every operand must be float32");
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), md = mask.dimensions(), od = out->dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || od.size() != 4 || (has_mask && md.size() != 4))
    return ffi::Error::InvalidArgument(std::string(name) + ": q, k, v, out (and the mask) must be 4-D");
  DecodeAttentionShape d{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], vd[3], {0, 0, 0, 0},
                         has_mask != 0, is_causal != 0, lse->element_count() != 0,
                         static_cast<float>(std::isnan(scale) ? 1.0 / std::sqrt(static_cast<double>(qd[3])) : scale)};
  if (kd[0] != d.b || vd[0] != d.b || kd[3] != d.e || vd[1] != d.kv || vd[2] != d.s || d.kv == 0 ||
      d.heads % d.kv || od[0] != d.b || od[1] != d.heads || od[2] != d.length || od[3] != d.ev ||
      (d.lse && lse->element_count() != d.b * d.heads * d.length))
    return ffi::Error::InvalidArgument(std::string(name) + ": shapes do not match");
  if (d.has_mask) {
    const int64_t full[4] = {d.b, d.heads, d.length, d.s};
    int64_t stride = 1;
    for (int i = 3; i >= 0; --i) {
      if (md[i] != full[i] && md[i] != 1)
        return ffi::Error::InvalidArgument(std::string(name) + ": the mask does not broadcast to the scores");
      d.mask_strides[i] = md[i] == 1 ? 0 : stride;
      stride *= md[i];
    }
  }
  decode_attention_calls.fetch_add(1, std::memory_order_relaxed);
  auto qs = static_cast<const float*>(q.untyped_data()), ks = static_cast<const float*>(k.untyped_data());
  auto vs = static_cast<const float*>(v.untyped_data()), ms = static_cast<const float*>(mask.untyped_data());
  auto os = static_cast<float*>(out->untyped_data()), ls = static_cast<float*>(lse->untyped_data());
  const int64_t units = d.b * d.kv;  // one (sample, kv head) each
  if (units == 0 || d.heads == 0 || d.length == 0 || d.ev == 0) return ffi::Error::Success();
  // Two chunks of kv heads per thread, one worker per core.
  return split_columns(pool, units, d.b * d.heads * d.length * d.s * (d.e + d.ev), kDecodeAttentionSplitMacs, 1, 2,
                       /*one_helper_per_core=*/true, name, [&](int64_t lo, int64_t hi) {
                         std::vector<float> scores;
                         for (int64_t u = lo; u < hi; ++u)
                           decode_attention_head(d, qs, ks, vs, ms, os, ls, u / d.kv, u % d.kv, scores);
                       });
}

// ---------------------------------------------------------------------------------------------
// Elementwise regions: float32 elementwise ops of one shape that write several results (an
// optimizer's update of one parameter: the parameter and its moments), in one pass over their
// inputs. XLA:CPU fuses such a region into one loop per result (AdamW: three, which read the
// gradient and the moments again: 10 passes over the parameter's size where one loop needs 7).
// lowering/regions.py writes each region's loop as C++, every value of an element in registers,
// and compiles it for this CPU into a library of its own (`kernel`, its path), which the handler
// loads once. An element's results are written after its inputs are read, so a result may share
// its buffer with an input (the parameter it replaces), as lowering aliases them.

std::atomic<int64_t> elementwise_calls{0};  // fx2xla_elementwise_calls

// The region loop's signature: inputs, then the scalar inputs' values followed by the region's
// constants, then the results; elements [lo, hi).
using RegionLoop = void (*)(const float* const*, const float*, float* const*, int64_t, int64_t);

// Below this many bytes read and written, one thread runs the region.
constexpr int64_t kElementwiseSplitBytes = 1 << 20;

// The loop in the library at `path`, loaded on first use and kept for the process's life (nullptr,
// with `why` set, where it does not load).
RegionLoop region_loop(std::string_view path, std::string& why) {
  static std::mutex mu;
  static std::unordered_map<std::string, RegionLoop> loops;
  std::lock_guard<std::mutex> lock(mu);
  std::string key(path);
  auto found = loops.find(key);
  if (found != loops.end()) return found->second;
  void* lib = dlopen(key.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    why = dlerror();
    return nullptr;
  }
  auto loop = reinterpret_cast<RegionLoop>(dlsym(lib, "fx2xla_region"));
  if (loop == nullptr) {
    why = "no fx2xla_region in " + key;
    return nullptr;
  }
  loops.emplace(key, loop);
  return loop;
}

ffi::Error Elementwise(ffi::ThreadPool pool, ffi::RemainingArgs args, ffi::RemainingRets rets,
                       std::string_view kernel, ffi::Span<const float> constants, int64_t vectors) {
  const char* name = "fx2xla_elementwise";
  auto bad = [&](const std::string& why) { return ffi::Error::InvalidArgument(std::string(name) + ": " + why); };
  int64_t nargs = static_cast<int64_t>(args.size()), nrets = static_cast<int64_t>(rets.size());
  if (vectors < 1 || vectors > nargs || nrets < 1) return bad("no inputs or no results");
  std::vector<const float*> in(vectors);
  std::vector<float> scalars;
  int64_t n = -1;
  for (int64_t i = 0; i < nargs; ++i) {
    auto arg = args.get<ffi::AnyBuffer>(i);
    if (arg.has_error() || arg->element_type() != ffi::DataType::F32) return bad("every input must be float32");
    int64_t count = static_cast<int64_t>(arg->element_count());
    if (i < vectors) {
      if (n >= 0 && count != n) return bad("the inputs differ in size");
      n = count;
      in[i] = static_cast<const float*>(arg->untyped_data());
    } else {
      if (count != 1) return bad("a scalar input must hold one element");
      scalars.push_back(*static_cast<const float*>(arg->untyped_data()));
    }
  }
  for (float c : constants) scalars.push_back(c);
  std::vector<float*> out(nrets);
  for (int64_t j = 0; j < nrets; ++j) {
    auto ret = rets.get<ffi::AnyBuffer>(j);
    if (ret.has_error() || (*ret)->element_type() != ffi::DataType::F32 ||
        static_cast<int64_t>((*ret)->element_count()) != n)
      return bad("every result must be float32, of the inputs' size");
    out[j] = static_cast<float*>((*ret)->untyped_data());
  }
  std::string why;
  RegionLoop loop = region_loop(kernel, why);
  if (loop == nullptr) return ffi::Error(ffi::ErrorCode::kInternal, std::string(name) + ": " + why);
  elementwise_calls.fetch_add(1, std::memory_order_relaxed);
  if (n == 0) return ffi::Error::Success();
  // Whole 64-byte lines per slice: two threads never write into one line.
  return split_columns(pool, n, n * 4 * (vectors + nrets), kElementwiseSplitBytes, 16, 2,
                       /*one_helper_per_core=*/true, name, [&](int64_t lo, int64_t hi) {
                         loop(in.data(), scalars.data(), out.data(), lo, hi);
                       });
}

}  // namespace

// The attributes both convolution handlers take, in torch's argument order.
template <typename Binding>
auto ConvolutionAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<ffi::Span<const int64_t>>("stride")
      .template Attr<ffi::Span<const int64_t>>("padding")
      .template Attr<ffi::Span<const int64_t>>("dilation")
      .template Attr<int64_t>("transposed")
      .template Attr<ffi::Span<const int64_t>>("output_padding")
      .template Attr<int64_t>("groups");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_torch_convolution, Convolution,
                              ConvolutionAttrs(ffi::Ffi::Bind()
                                                   .Ctx<ffi::ThreadPool>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("channels_last")
                                  .Attr<int64_t>("has_bias"));

// A gradient whose mask is 0 is neither computed nor written (the caller drops its buffer).
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_torch_convolution_backward, ConvolutionBackward,
                              ConvolutionAttrs(ffi::Ffi::Bind()
                                                   .Ctx<ffi::ThreadPool>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Arg<ffi::AnyBuffer>()
                                                   .Ret<ffi::AnyBuffer>()
                                                   .Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("input_mask")
                                  .Attr<int64_t>("weight_mask")
                                  .Attr<int64_t>("channels_last"));

// What both attention handlers take: q, k, v and a mask; the output and the logsumexp; and, after
// the attributes of their own, has_mask, is_causal and scale.
template <typename Binding>
auto AttentionOperands(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

template <typename Binding>
auto AttentionFlags(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("has_mask")
      .template Attr<int64_t>("is_causal")
      .template Attr<double>("scale");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_torch_attention, Attention,
                              AttentionFlags(AttentionOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())
                                                 .Attr<int64_t>("q_seq")
                                                 .Attr<int64_t>("k_seq")
                                                 .Attr<int64_t>("v_seq")
                                                 .Attr<int64_t>("out_seq")));

// How many attention handler calls ran so far, in this process.
extern "C" int64_t fx2xla_torch_attention_calls() { return attention_calls.load(); }
// Whether handlers hold MKL's thread count for their thread too (torch's library has MKL).
extern "C" int fx2xla_torch_kernels_hold_mkl() { return mkl_set_local() != nullptr; }

// W laid out [N, K] where w_nk is 1, else [K, N].
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_skinny_matmul, SkinnyMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("w_nk"));

// How many skinny matmul calls ran so far, in this process.
extern "C" int64_t fx2xla_skinny_matmul_calls() { return skinny_calls.load(); }

// op(a) . op(b), a transposed where transpose_a is 1 (a laid out [K, M]), b where transpose_b is
// 1 (b laid out [N, K]); float32 or float64.
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_torch_matmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("transpose_a")
                                  .Attr<int64_t>("transpose_b"));

// How many torch matmul calls ran so far, in this process.
extern "C" int64_t fx2xla_torch_matmul_calls() { return matmul_calls.load(); }

// A buffer for a folded loop's stacked per-iteration outputs, left as XLA allocated it: every
// element is written by the loop, one iteration's slice each (lowering/control_flow.py), so the
// zero fill jax's scan starts from (a broadcast over the whole stack) would only be overwritten.
ffi::Error Uninitialized(ffi::Result<ffi::AnyBuffer>) { return ffi::Error::Success(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_uninitialized, Uninitialized, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());

// a . op(stack[index]): one layer's weight of a folded loop read in place; transpose_b is 1 where
// the stack holds each weight [N, K] (nn.Linear's), 0 where [K, N].
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_torch_matmul_indexed, MatmulIndexed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("transpose_b"));

// How many indexed torch matmul calls ran so far, in this process.
extern "C" int64_t fx2xla_torch_matmul_indexed_calls() { return indexed_matmul_calls.load(); }

// ---------------------------------------------------------------------------------------------
// Grouped matmuls: a mixture-of-experts layer's products, the rows sorted by expert. offs [E]
// holds the cumulative ends of the experts' ranges (int32 or int64), as transformers'
// `grouped_mm_fallback` and torch's `_grouped_mm` take them: expert e owns [offs[e-1], offs[e]).
//   mode 0 (rows): c[M, N]; expert e's rows of c = its rows of a[M, K] . b[e] (b [E, K, N]); rows
//     past the last end are zero.
//   mode 1 (contraction): c[E, X, N]; c[e] = a[:, range e] . b[range e, :] (a [X, T], b [T, N]):
//     the weight gradient of mode 0; zero for an expert with an empty range.
// transpose_a / transpose_b: the operand is stored transposed (its last two dims swapped), as a
// `W^T` or `x^T` view arrives, and is read in place. Each expert's part is one gemm of torch's
// on exactly its rows (eager's own kernels), where XLA has only a masked dense form (jax's
// ragged_dot: every expert's weight against every row). Ends are clamped into [the previous
// end, the ragged length], so that no offs reads or writes outside the buffers.

std::atomic<int64_t> grouped_matmul_calls{0};  // fx2xla_grouped_matmul_calls

std::vector<int64_t> group_ends(const ffi::AnyBuffer& offs, int64_t length) {
  int64_t e = static_cast<int64_t>(offs.element_count());
  std::vector<int64_t> ends(e);
  int64_t prev = 0;
  for (int64_t i = 0; i < e; ++i) {
    int64_t v = offs.element_type() == ffi::DataType::S32 ? static_cast<const int32_t*>(offs.untyped_data())[i]
                                                          : static_cast<const int64_t*>(offs.untyped_data())[i];
    prev = ends[i] = std::clamp<int64_t>(v, prev, length);
  }
  return ends;
}

ffi::Error GroupedMatmul(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer offs,
                         ffi::Result<ffi::AnyBuffer> c, int64_t mode, int64_t transpose_a, int64_t transpose_b) {
  auto dtype = torch_dtype(a.element_type());
  if (!dtype || b.element_type() != a.element_type() || c->element_type() != a.element_type() ||
      (offs.element_type() != ffi::DataType::S32 && offs.element_type() != ffi::DataType::S64) ||
      offs.dimensions().size() != 1)
    return ffi::Error::InvalidArgument(
        "fx2xla_grouped_matmul: a, b and c must share a float dtype, offs be a vector of int32/int64");
  int64_t groups = static_cast<int64_t>(offs.element_count());
  auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  // logical shapes: mode 0 a [M, K], b [E, K, N]; mode 1 a [X, T], b [T, N]
  if (ad.size() != 2 || bd.size() != (mode == 0 ? 3u : 2u) || cd.size() != (mode == 0 ? 2u : 3u))
    return ffi::Error::InvalidArgument("fx2xla_grouped_matmul: operand ranks do not match the mode");
  int64_t a0 = transpose_a ? ad[1] : ad[0], a1 = transpose_a ? ad[0] : ad[1];
  int64_t r = bd.size() - 2, b0 = transpose_b ? bd[r + 1] : bd[r], b1 = transpose_b ? bd[r] : bd[r + 1];
  bool ok = mode == 0 ? (bd[0] == groups && a1 == b0 && cd[0] == a0 && cd[1] == b1)
                      : (a1 == b0 && cd[0] == groups && cd[1] == a0 && cd[2] == b1);
  if (!ok) return ffi::Error::InvalidArgument("fx2xla_grouped_matmul: shapes do not chain");
  grouped_matmul_calls.fetch_add(1, std::memory_order_relaxed);
  return guarded("torch grouped matmul", [&] {
    at::Tensor at_ = as_tensor(a, *dtype), bt = as_tensor(b, *dtype), ct = as_tensor(*c, *dtype);
    if (transpose_a) at_ = at_.t();
    if (transpose_b) bt = bt.transpose(-2, -1);
    auto ends = group_ends(offs, mode == 0 ? a0 : a1);
    int64_t start = 0;
    for (int64_t e = 0; e < groups; ++e) {
      int64_t end = ends[e];
      if (mode == 0 && end > start) {
        at::Tensor ce = ct.slice(0, start, end);
        torch_mm_into(pool, ce, at_.slice(0, start, end), bt.select(0, e));
      } else if (mode == 1) {
        at::Tensor ce = ct.select(0, e);
        if (end > start) torch_mm_into(pool, ce, at_.slice(1, start, end), bt.slice(0, start, end));
        else ce.zero_();
      }
      start = end;
    }
    if (mode == 0 && start < a0) ct.slice(0, start, a0).zero_();
  });
}

// The grouped product of a and b over offs's ranges (see above for the modes and layouts).
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_grouped_matmul, GroupedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("mode")
                                  .Attr<int64_t>("transpose_a")
                                  .Attr<int64_t>("transpose_b"));

// How many grouped matmul calls ran so far, in this process.
extern "C" int64_t fx2xla_grouped_matmul_calls() { return grouped_matmul_calls.load(); }

// Float32 elementwise regions (lowering/regions.py): the `vectors` inputs of the region's size,
// then its scalar inputs (one element each); `kernel`, the path of the region's compiled loop.
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_elementwise, Elementwise,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<std::string_view>("kernel")
                                  .Attr<ffi::Span<const float>>("constants")
                                  .Attr<int64_t>("vectors"));

// How many elementwise region calls ran so far, in this process.
extern "C" int64_t fx2xla_elementwise_calls() { return elementwise_calls.load(); }

// W laid out [N, K]; x, W and y float32.
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_few_rows_matmul, FewRowsMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

// How many few-row matmul calls ran so far, in this process.
extern "C" int64_t fx2xla_few_rows_matmul_calls() { return few_rows_calls.load(); }

// q [B, H, L, E], k [B, KV, S, E], v [B, KV, S, Ev], a float32 mask that broadcasts to [B, H, L, S]
// (ignored unless has_mask); out [B, H, L, Ev], and the logsumexp [B, H, L] or an empty buffer.
XLA_FFI_DEFINE_HANDLER_SYMBOL(fx2xla_decode_attention, DecodeAttention,
                              AttentionFlags(AttentionOperands(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

// How many decode attention calls ran so far, in this process.
extern "C" int64_t fx2xla_decode_attention_calls() { return decode_attention_calls.load(); }

// Process-wide: whether the handlers cut batches into slices (see `slices`); returns the previous
// setting. Off, every call runs torch's kernel once on the whole batch, as eager does.
extern "C" int fx2xla_torch_kernels_set_slicing(int on) { return slicing.exchange(on != 0); }

// Process-wide: whether a split's caller polls briefly for the parts still running elsewhere
// before it sleeps (wait_split_briefly); returns the previous setting.
extern "C" int fx2xla_set_split_spin(int on) { return split_spin.exchange(on != 0); }

// Of every split so far in this process: how many callers waited for parts running elsewhere, how
// many of those polled, and how many saw the parts end while polling (no sleep).
extern "C" void fx2xla_split_waits(int64_t* waits, int64_t* polled, int64_t* polled_out) {
  *waits = split_waits.load();
  *polled = split_polled.load();
  *polled_out = split_polled_out.load();
}

// How many handler calls cut their batch into slices so far, in this process.
extern "C" int64_t fx2xla_torch_kernels_sliced_calls() { return sliced_calls.load(); }

// The parts of every split so far in this process, and how many of them ran on a thread other
// than the handler's caller (XLA's pool or a helper).
extern "C" void fx2xla_split_parts(int64_t* parts, int64_t* elsewhere) {
  *parts = split_parts.load();
  *elsewhere = split_parts_elsewhere.load();
}

// Pins the `bytes` bytes at `data`: the buffer of a weight the caller holds, whose bytes stay the
// weight's while pinned (see packed_weight). Pinning a pinned buffer again drops its packs.
extern "C" void fx2xla_torch_kernels_pin(const void* data, int64_t bytes) {
  std::lock_guard<std::mutex> lock(pinned_mu);
  pinned.insert_or_assign(data, PinnedWeight{static_cast<size_t>(bytes), {}});
  pinned_count.store(static_cast<int64_t>(pinned.size()));
}

// Unpins `data` and frees its packed copies (a call that took one keeps its reference).
extern "C" void fx2xla_torch_kernels_unpin(const void* data) {
  std::lock_guard<std::mutex> lock(pinned_mu);
  pinned.erase(data);
  pinned_count.store(static_cast<int64_t>(pinned.size()));
}

// How many buffers are pinned now.
extern "C" int64_t fx2xla_torch_kernels_pinned() { return pinned_count.load(); }

// Process-wide: whether convolutions use packed copies of pinned weights; returns the previous
// setting.
extern "C" int fx2xla_torch_kernels_set_packing(int on) { return packing.exchange(on != 0); }

// Whether packed convolutions write into XLA's result buffer (packed_convolution_into; the
// default) or into a tensor of torch's that is then copied there. Returns the previous setting.
extern "C" int fx2xla_torch_kernels_set_in_place(int on) { return in_place.exchange(on != 0); }

// How many weights were packed, and how many convolution calls (slices) ran on a packed weight,
// so far in this process.
extern "C" int64_t fx2xla_torch_kernels_packs_made() { return packs_made.load(); }
extern "C" int64_t fx2xla_torch_kernels_packed_calls() { return packed_calls.load(); }
extern "C" int64_t fx2xla_torch_kernels_written_in_place() { return written_in_place.load(); }

// ---------------------------------------------------------------------------------------------
// Parking torch's OpenMP workers while an XLA:CPU executable runs.
//
// After each parallel region, torch's OpenMP workers spin for milliseconds (GNU OpenMP's default
// wait policy) on the cores XLA's threads need next: an executable launched right after eager
// torch work ran at half speed. fx2xla therefore parks them for a long executable's launch when
// a worker of the main thread's team is running at that moment. Only the main thread's team: a
// team is found by running a region on it, and other threads' teams would be started by the
// search itself.
//
// Two ways to park, both until the launch returns:
// - A signal (the default where every worker takes it): each worker is sent one, and its handler
//   sleeps on a futex until the launch is done. The worker then goes back to whatever it was
//   doing, spinning included: GNU OpenMP counts its spin in iterations, so the rest of it runs
//   later, in the gaps between calls. Nothing of the team's own state changes, and the launch
//   waits for no one.
// - A parallel region of the team whose other members sleep on a condition variable. Its end
//   costs the launch a worker's wake-up (~0.2 ms on a 2-core VM), and starts a new spin after it,
//   which the next call, coming within it, parks again: a decode loop paid that at most steps.
// While parked, the launch runs with torch and MKL at one thread on this thread, so that
// nothing it does waits for a parked worker (in the region, nested regions are serial anyway).
namespace {

struct Team {
  int size = -1;                  // torch's thread count when the workers were found
  int64_t exits = -1;             // worker_exits then
  std::vector<clockid_t> clocks;  // each worker's CPU-time clock
  std::vector<pid_t> tids;        // each worker's thread id
  bool signal_ok = false;         // every worker found, none blocks the park signal
};
Team main_team;  // the main thread's: only it reads or writes this

// Counts exits of threads that were found as workers (each one's thread-local destructor): after
// one, its clock id could name a thread that reuses the id, so the team is looked for again.
std::atomic<int64_t> worker_exits{0};
struct ExitCount {
  bool armed = false;
  ~ExitCount() {
    if (armed) worker_exits.fetch_add(1);
  }
};

// A worker's CPU time, or -1 where its clock cannot be read.
int64_t cpu_ns(clockid_t clock) {
  timespec ts;
  if (clock_gettime(clock, &ts) != 0) return -1;
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// The futex word parked workers sleep on: 1 while a launch runs parked by signal.
int park_word = 0;
int park_signal = 0;  // the real-time signal taken for parking; 0: none could be
std::atomic<bool> park_signals{true};  // fx2xla_set_park_signals
std::atomic<int64_t> signal_parked_calls{0};  // fx2xla_signal_parked_calls
std::atomic<int64_t> signal_parks_taken{0};  // fx2xla_signal_parks_taken: handler entries

int64_t monotonic_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// The longest a worker stays parked by one signal. A worker is stopped wherever the signal finds
// it; should that be inside a lock the launch then needs (a malloc arena's, say), the launch
// waits this long instead of forever. Its spin lasts milliseconds, so a launch longer than this
// loses little to what is left of it.
constexpr int64_t kMaxParkNs = 100 * 1000 * 1000;

// Async-signal-safe: atomics, clock_gettime, futex and errno only.
void park_handler(int) {
  int saved = errno;
  signal_parks_taken.fetch_add(1, std::memory_order_relaxed);
  const int64_t deadline = monotonic_ns() + kMaxParkNs;
  while (__atomic_load_n(&park_word, __ATOMIC_ACQUIRE) == 1) {
    int64_t left = deadline - monotonic_ns();
    if (left <= 0) break;
    timespec limit{static_cast<time_t>(left / 1000000000), static_cast<long>(left % 1000000000)};
    syscall(SYS_futex, &park_word, FUTEX_WAIT_PRIVATE, 1, &limit, nullptr, 0);
  }
  errno = saved;
}

// Takes the highest real-time signal nobody handles (its action still the default) into
// park_signal, on the first call (from the main thread only: find_workers).
int take_park_signal() {
  static bool tried = false;
  if (tried) return park_signal;
  tried = true;
  for (int sig = SIGRTMAX; sig >= SIGRTMIN; --sig) {
    struct sigaction now {};
    if (sigaction(sig, nullptr, &now) != 0 || now.sa_handler != SIG_DFL || (now.sa_flags & SA_SIGINFO)) continue;
    struct sigaction act {};
    act.sa_handler = park_handler;
    sigemptyset(&act.sa_mask);
    act.sa_flags = SA_RESTART;
    if (sigaction(sig, &act, nullptr) == 0) return park_signal = sig;
  }
  return 0;
}

#if AT_PARALLEL_OPENMP
void find_workers(Team& team, int threads) {
  int sig = take_park_signal();
  std::vector<clockid_t> clocks(threads);
  std::vector<pid_t> tids(threads);
  std::vector<char> found(threads, 0), takes(threads, 0);
#pragma omp parallel num_threads(threads)
  {
    int i = omp_get_thread_num();
    if (i > 0 && pthread_getcpuclockid(pthread_self(), &clocks[i]) == 0) {
      static thread_local ExitCount exit_count;
      exit_count.armed = true;
      found[i] = 1;
      tids[i] = static_cast<pid_t>(syscall(SYS_gettid));
      sigset_t mask;
      takes[i] = sig != 0 && pthread_sigmask(SIG_BLOCK, nullptr, &mask) == 0 && !sigismember(&mask, sig);
    }
  }
  team.exits = worker_exits.load();
  team.clocks.clear();
  team.tids.clear();
  team.signal_ok = sig != 0;
  for (int i = 1; i < threads; ++i) {
    if (found[i]) {
      team.clocks.push_back(clocks[i]);
      team.tids.push_back(tids[i]);
    }
    team.signal_ok = team.signal_ok && found[i] && takes[i];
  }
  team.size = threads;
}

// The main team as torch runs it now, looked for again where torch's thread count changed or a
// worker exited.
Team& current_team(int threads) {
  if (main_team.size != threads || main_team.exits != worker_exits.load()) find_workers(main_team, threads);
  return main_team;
}
#endif

bool on_main_thread() { return syscall(SYS_gettid) == getpid(); }

// Whether the park signal still runs park_handler: another library may have taken the signal
// for itself since.
bool park_handler_installed() {
  struct sigaction now {};
  return park_signal != 0 && sigaction(park_signal, nullptr, &now) == 0 && !(now.sa_flags & SA_SIGINFO) &&
         now.sa_handler == park_handler;
}

#if AT_PARALLEL_OPENMP
// The main thread's team, whose workers the two functions below watch: null off the main thread,
// inside a region, or where torch runs one thread.
Team* watched_team() {
  if (!on_main_thread() || omp_in_parallel()) return nullptr;
  int threads = at::get_num_threads();
  return threads < 2 ? nullptr : &current_team(threads);
}
#endif

}  // namespace

// 1 where the calling thread is the process's main thread, outside a parallel region, torch runs
// more than one thread, and a worker of its team is running now (its CPU clock advances across
// two reads, a syscall apart: spinning after a region, or working); else 0.
extern "C" int fx2xla_torch_team_running() {
#if AT_PARALLEL_OPENMP
  Team* found = watched_team();
  if (!found) return 0;
  Team& team = *found;
  std::vector<int64_t> before;
  before.reserve(team.clocks.size());
  for (clockid_t c : team.clocks) before.push_back(cpu_ns(c));
  for (size_t i = 0; i < team.clocks.size(); ++i)
    if (cpu_ns(team.clocks[i]) != before[i]) return 1;
#endif
  return 0;
}

// The CPU time the other members of the main thread's torch team have run so far, in ns (0 where
// torch is not on OpenMP, runs one thread, or this is not the main thread): while a call is
// parked it stands still.
extern "C" int64_t fx2xla_torch_team_cpu_ns() {
#if AT_PARALLEL_OPENMP
  Team* team = watched_team();
  if (!team) return 0;
  int64_t total = 0;
  for (clockid_t c : team->clocks) total += cpu_ns(c);
  return total;
#else
  return 0;
#endif
}

std::atomic<int64_t> parked_calls{0};  // fx2xla_parked_calls

// Runs fn(arg) on the calling thread with the other members of its torch team parked until fn
// returns; returns fn's result. Plainly where torch is not on OpenMP, runs one thread, or the
// caller is inside a region or not the main thread (only the main team is known).
extern "C" int fx2xla_run_parked(int (*fn)(void*), void* arg) {
#if AT_PARALLEL_OPENMP
  int threads = at::get_num_threads();
  if (threads < 2 || omp_in_parallel() || !on_main_thread() || __atomic_load_n(&park_word, __ATOMIC_ACQUIRE))
    return fn(arg);
  parked_calls.fetch_add(1, std::memory_order_relaxed);
  Team& team = current_team(threads);
  if (park_signals.load() && team.signal_ok && park_handler_installed()) {
    signal_parked_calls.fetch_add(1, std::memory_order_relaxed);
    __atomic_store_n(&park_word, 1, __ATOMIC_RELEASE);
    for (pid_t tid : team.tids) syscall(SYS_tgkill, getpid(), tid, park_signal);
    int result;
    {
      SingleThreaded one;
      result = fn(arg);
    }
    __atomic_store_n(&park_word, 0, __ATOMIC_RELEASE);
    syscall(SYS_futex, &park_word, FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
    return result;
  }
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  int result = 0;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      result = fn(arg);
      {
        std::lock_guard<std::mutex> lock(mu);
        done = true;
      }
      cv.notify_all();
    } else {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return done; });
    }
  }
  return result;
#else
  return fn(arg);
#endif
}

// Whether fx2xla_run_parked may park by signal (1, the default) or only with a region (0), for
// every later call; returns the previous setting.
extern "C" int fx2xla_set_park_signals(int on) { return park_signals.exchange(on != 0) ? 1 : 0; }

// The real-time signal taken for parking (0 until the main team was first looked for, or where
// none was free).
extern "C" int fx2xla_park_signal() { return park_signal; }

// How many calls were parked by signal so far in this process, and how many times a worker
// entered the signal's handler.
extern "C" int64_t fx2xla_signal_parked_calls() { return signal_parked_calls.load(); }
extern "C" int64_t fx2xla_signal_parks_taken() { return signal_parks_taken.load(); }

// An execution about to launch asks the library's helper threads to poll for the parts of its
// splits until fx2xla_help_end (see Helping); they are started at the first ask.
extern "C" void fx2xla_help_begin() {
  std::call_once(helping.started, [] {
    for (int64_t i = 0; i < helper_count(); ++i) std::thread(helper_loop).detach();
  });
  {
    std::lock_guard<std::mutex> lock(helping.mu);
    helping.asking.fetch_add(1, std::memory_order_acq_rel);
  }
  helping.wake.notify_all();
}

extern "C" void fx2xla_help_end() { helping.asking.fetch_sub(1, std::memory_order_acq_rel); }

// How many parts of the library's splits helper threads ran so far, in this process.
extern "C" int64_t fx2xla_helped_parts() { return helping.parts.load(); }

// How many helper threads an execution that asks for help gets (0: this process has one core).
extern "C" int64_t fx2xla_helper_count() { return helper_count(); }

// How many executions are asking for help now.
extern "C" int64_t fx2xla_help_asks() { return helping.asking.load(); }

// How many calls ran with their team parked so far, in this process.
extern "C" int64_t fx2xla_parked_calls() { return parked_calls.load(); }
