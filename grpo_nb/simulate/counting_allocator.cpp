// A counting allocator for PyTorch's meta and CPU devices (see tracker.py).
//
// Registered with c10::SetAllocator, it sees every storage those devices allocate and
// free, including the temporaries of C++ kernels that no Python hook can see. On the meta
// device it replaces the default allocator, which hands out no memory at all: a storage
// gets a null data pointer and a context that remembers its size. On the CPU it wraps the
// allocator it found and forwards to it, so real tensors keep working (the honesty check
// compares a real CPU step with its meta simulation).
//
// While counting is on, every allocation and free is appended to an event log that
// Python replays for the timeline and for what is live at the peak; an optional Python
// callback names the larger allocations (where in the code they were made).

#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

struct Event {
  int64_t id;     // allocation id (the same for its free)
  int64_t bytes;  // > 0: allocated, < 0: freed
  int32_t label;  // from the labeler, -1 when not labelled
  int32_t phase;  // set by Python
  int32_t host;   // 1: counted as host memory (offloaded copies)
  int32_t device; // 0: meta, 1: cpu
};

struct Record {
  int64_t session;  // counting session it was allocated in (-1: none)
  int64_t id;
  int64_t bytes;
  int32_t host;
  int32_t device;
  c10::DataPtr inner;  // the wrapped allocator's allocation (CPU only)
};

typedef int32_t (*Labeler)(int64_t bytes);

std::mutex mutex;
std::vector<Event> events;
std::atomic<bool> counting{false};
std::atomic<int32_t> paused{0};  // > 0: allocations are not counted (Python meta kernels' temporaries)
std::atomic<int64_t> next_id{0};
int64_t session = 0;
int64_t live[2] = {0, 0};  // [device, host]
int64_t peak[2] = {0, 0};
int32_t phase = 0;
int32_t counted_device = 0;  // the device whose allocations this session counts
int32_t host_mode = 0;
Labeler labeler = nullptr;
int64_t label_threshold = 0;
thread_local bool in_labeler = false;

void on_alloc(Record* r) {
  if (!counting.load() || paused.load() > 0 || r->device != counted_device) return;
  int32_t label = -1;
  if (labeler != nullptr && r->bytes >= label_threshold && !in_labeler) {
    in_labeler = true;
    label = labeler(r->bytes);
    in_labeler = false;
  }
  std::lock_guard<std::mutex> guard(mutex);
  r->session = session;
  r->id = next_id++;
  r->host = host_mode;
  int64_t& now = live[r->host];
  now += r->bytes;
  if (now > peak[r->host]) peak[r->host] = now;
  events.push_back({r->id, r->bytes, label, phase, r->host, r->device});
}

void on_free(Record* r) {
  std::lock_guard<std::mutex> guard(mutex);
  if (r->session != session) return;  // allocated while not counting, or in an earlier session
  live[r->host] -= r->bytes;
  if (counting.load()) events.push_back({r->id, -r->bytes, -1, phase, r->host, r->device});
}

void delete_record(void* ctx) {
  auto* r = static_cast<Record*>(ctx);
  on_free(r);
  delete r;  // frees the wrapped allocation too (CPU)
}

struct MetaAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto* r = new Record{-1, -1, static_cast<int64_t>(n), 0, 0, c10::DataPtr()};
    on_alloc(r);
    return {nullptr, r, &delete_record, c10::Device(c10::DeviceType::Meta)};
  }
  void copy_data(void*, const void*, std::size_t) const override {}
};

// On the CPU the context is the data pointer itself (a "simple" DataPtr, as the default CPU
// allocator's), because some kernels (oneDNN's) use raw_allocate / raw_deallocate, which need
// it; the records are found by address instead.
std::unordered_map<void*, Record*> cpu_records;
c10::DeleterFnPtr cpu_inner_raw_deleter = nullptr;

void delete_cpu(void* data) {
  Record* r = nullptr;
  {
    std::lock_guard<std::mutex> guard(mutex);
    auto it = cpu_records.find(data);
    if (it != cpu_records.end()) {
      r = it->second;
      cpu_records.erase(it);
    }
  }
  if (r == nullptr) {  // allocated while not counting, then freed through the raw interface
    cpu_inner_raw_deleter(data);
    return;
  }
  on_free(r);
  delete r;  // frees the wrapped allocation
}

struct CpuAllocator final : public c10::Allocator {
  c10::Allocator* inner = nullptr;
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr dp = inner->allocate(n);
    void* data = dp.get();
    if (!counting.load() || n == 0 || data == nullptr) return dp;  // the inner allocator's own DataPtr
    auto* r = new Record{-1, -1, static_cast<int64_t>(n), 0, 1, std::move(dp)};
    on_alloc(r);
    {
      std::lock_guard<std::mutex> guard(mutex);
      cpu_records[data] = r;
    }
    return {data, data, &delete_cpu, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &delete_cpu; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

MetaAllocator meta_allocator;
CpuAllocator cpu_allocator;
bool meta_installed = false, cpu_installed = false;

}  // namespace

extern "C" {

// Install for the meta device (0) or the CPU (1); once per process, counting starts off.
void grpo_nb_install(int32_t device) {
  if (device == 0 && !meta_installed) {
    c10::SetAllocator(c10::DeviceType::Meta, &meta_allocator, 255);
    meta_installed = true;
  }
  if (device == 1 && !cpu_installed) {
    cpu_allocator.inner = c10::GetAllocator(c10::DeviceType::CPU);
    cpu_inner_raw_deleter = cpu_allocator.inner->raw_deleter();
    c10::SetAllocator(c10::DeviceType::CPU, &cpu_allocator, 255);
    cpu_installed = true;
  }
}

void grpo_nb_start(int32_t device) {
  std::lock_guard<std::mutex> guard(mutex);
  counted_device = device;
  events.clear();
  ++session;
  live[0] = live[1] = peak[0] = peak[1] = 0;
  phase = 0;
  host_mode = 0;
  counting.store(true);
}

void grpo_nb_stop() { counting.store(false); }
void grpo_nb_pause(int32_t delta) { paused += delta; }
void grpo_nb_set_phase(int32_t p) { std::lock_guard<std::mutex> guard(mutex); phase = p; }
void grpo_nb_set_host(int32_t h) { std::lock_guard<std::mutex> guard(mutex); host_mode = h; }
void grpo_nb_set_labeler(Labeler fn, int64_t threshold) { labeler = fn; label_threshold = threshold; }
int64_t grpo_nb_live(int32_t host) { std::lock_guard<std::mutex> guard(mutex); return live[host]; }
int64_t grpo_nb_peak(int32_t host) { std::lock_guard<std::mutex> guard(mutex); return peak[host]; }
void grpo_nb_reset_peak() {
  std::lock_guard<std::mutex> guard(mutex);
  peak[0] = live[0];
  peak[1] = live[1];
}
int64_t grpo_nb_event_count() { std::lock_guard<std::mutex> guard(mutex); return static_cast<int64_t>(events.size()); }
// Copies events [start, start + count) into `out` (an array of Event).
void grpo_nb_copy_events(Event* out, int64_t start, int64_t count) {
  std::lock_guard<std::mutex> guard(mutex);
  for (int64_t i = 0; i < count; ++i) out[i] = events[start + i];
}

}  // extern "C"
