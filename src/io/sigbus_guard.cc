// Reads of mapped source bytes by the daemon itself (a widened tensor is
// converted from its mapping). A source file cut short under a mapping makes
// the reading thread fault (SIGBUS); the handler jumps back to the guarded
// call, which reports it, and leaves any other SIGBUS to the disposition it
// replaced.
#include <setjmp.h>
#include <signal.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "ckptfs/io.h"

namespace ckptfs {
namespace {

// Where the guarded call on this thread resumes; null outside one. Read by
// the handler: a plain TLS pointer of the executable (initial-exec).
thread_local sigjmp_buf* t_resume = nullptr;
struct sigaction g_previous;
std::atomic<bool> g_installed{false};

void OnSigbus(int sig, siginfo_t* info, void* context) {
  if (sigjmp_buf* resume = t_resume) {
    t_resume = nullptr;
    siglongjmp(*resume, 1);
  }
  // Not a guarded read: what would have happened without this handler.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
    g_previous.sa_handler(sig);
  } else {
    // Returning re-runs the faulting access, which now gets the default action.
    ::signal(SIGBUS, SIG_DFL);
  }
}

}  // namespace

// ThreadSanitizer's runtime cannot leave a SIGBUS handler by siglongjmp (the
// process dies in it), so a TSan build reads conversions through the engine.
#if defined(__SANITIZE_THREAD__)
#define CKPTFS_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define CKPTFS_TSAN 1
#endif
#endif

Status InstallSigbusGuard() {
#ifdef CKPTFS_TSAN
  return Unsupported("no SIGBUS guard under ThreadSanitizer (it cannot leave a handler by siglongjmp)");
#endif
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_installed.load()) return Status::Ok();
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = OnSigbus;
  // SA_NODEFER: the handler leaves by siglongjmp without restoring a signal
  // mask, so SIGBUS must not be blocked while it runs.
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  if (::sigaction(SIGBUS, &sa, &g_previous) != 0) return ErrnoStatus("sigaction", "SIGBUS", errno);
  g_installed.store(true);
  return Status::Ok();
}

bool SigbusGuardInstalled() { return g_installed.load(std::memory_order_relaxed); }

bool RunGuarded(void (*fn)(void*), void* arg) {
  sigjmp_buf resume;
  // 0: no signal mask saved (no syscall); see SA_NODEFER above.
  if (sigsetjmp(resume, 0) != 0) return false;  // t_resume was cleared by the handler
  t_resume = &resume;
  fn(arg);
  t_resume = nullptr;
  return true;
}

}  // namespace ckptfs
