"""m6's C++ Adafactor step for the offloaded host update: torch.optim.Adafactor's math in three
passes over each fp32 tensor instead of torch's dozen, its loops over rows split across the cores.

Per tensor p, gradient g (a matrix, or a stack of matrices [..., R, C], is factored; a vector is not),
at step t with lr, weight decay wd, beta2_decay = -0.8, eps1 = fp32 eps, eps2 = 1e-3, d = 1:

    w = t^beta2_decay, rho = min(lr, 1 / sqrt(t)), alpha = max(eps2, ||p|| / sqrt(n)) * rho
    matrix:  row_var = lerp(row_var, mean_c g^2, w); col_var = lerp(col_var, mean_r g^2, w)
             v[r, c] = row_var[r] * col_var[c] / max(mean_r row_var, eps1)
    vector:  variance = lerp(variance, g^2, w); v = variance
    u = g * rsqrt(max(v, eps1^2)); p = p * (1 - lr wd) - alpha / max(1, ||u|| / (sqrt(n) d)) * u

pass 1 reads p and g (||p||, the row and column sums of g^2; the vector's variance written), pass 2
reads g (||u||), pass 3 reads g and rewrites p; u and v are never materialised. A matrix row where
no clamp engages (its smallest v >= eps1^2) forms u as g * rsqrt(row_var / mean) * rsqrt(col_var),
two multiplies an element (torch's order rounds a few ulp apart). State (``step``,
``row_var``, ``col_var``, ``variance``) is torch's own, so checkpoints move between the two.
Equal to torch's foreach Adafactor to float rounding (the sums are accumulated in double; tested to
1e-6 relative in tests/unit/test_host_adafactor.py).

The op is compiled at first use (torch.utils.cpp_extension.load_inline, ~1 min) into the same
``TORCH_EXTENSIONS_DIR`` as DeepSpeed's cpu_adam (m6.memory.host_optimizer.extensions_dir) and
loaded from there by later runs; where it cannot be built (no C++ compiler, no ninja), torch's
Adafactor runs the host update and one line says why.
"""

from __future__ import annotations

import hashlib
import platform
from types import ModuleType
from typing import Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from m6.memory.host_optimizer import error_gist, extensions_dir

OP_NAME = "m6_host_adafactor"


def op_name() -> str:
    """The op's name with a tag of this CPU's instruction set: it is compiled for the CPU it
    builds on (-march=native), so a cache shared by hosts of different CPUs keeps one build each."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{OP_NAME}_{hashlib.sha1(flags.encode()).hexdigest()[:8]}"

Log = Callable[[str], None]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

static inline float lerp_like_torch(float self, float end, float w) {
  // at::lerp's formula: exact at w = 1 (the first step), as torch's lerp_
  return (std::abs(w) < 0.5f) ? self + w * (end - self) : end - (end - self) * (1.0f - w);
}

// One Adafactor step of an fp32 contiguous CPU tensor; torch.optim.Adafactor's math (see the module).
void adafactor_step(torch::Tensor p, torch::Tensor g, torch::Tensor row_var, torch::Tensor col_var,
                    torch::Tensor variance, double step, double lr, double weight_decay,
                    double beta2_decay, double eps1, double eps2, double d) {
  const int64_t n = p.numel();
  float* P = p.data_ptr<float>();
  const float* G = g.data_ptr<float>();
  const float w = (float)std::pow(step, beta2_decay);
  const double rho = std::min(lr, 1.0 / std::sqrt(step));
  const float floor2 = (float)(eps1 * eps1);
  const bool factored = p.dim() > 1;
  const int64_t C = factored ? p.size(-1) : n;
  const int64_t R = factored ? p.size(-2) : 1;
  const int64_t B = factored ? n / (R * C) : 1;
  const int64_t rows = B * R;
  const int threads = at::get_num_threads();
  std::vector<double> psq(threads, 0.0), usq(threads, 0.0);
  float* V = variance.defined() ? variance.data_ptr<float>() : nullptr;
  float* RV = factored ? row_var.data_ptr<float>() : nullptr;
  float* CV = factored ? col_var.data_ptr<float>() : nullptr;
  std::vector<float> rowscale, rowinv, colinv, colmin;
  if (factored) {
    // pass 1: ||p||^2, row sums of g^2 (into row_var), column sums per thread then reduced
    std::vector<double> colsum((size_t)threads * B * C, 0.0);
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      const int t = at::get_thread_num();
      double ps = 0.0;
      for (int64_t r = r0; r < r1; ++r) {
        const float* gr = G + r * C; const float* pr = P + r * C;
        double* cs = colsum.data() + ((size_t)t * B + r / R) * C;
        float rs = 0.0f, prs = 0.0f;  // one row's sums in float lanes, the totals in double
#pragma omp simd reduction(+:rs, prs)
        for (int64_t c = 0; c < C; ++c) {
          const float gv = gr[c]; const float pv = pr[c];
          rs += gv * gv; prs += pv * pv; cs[c] += (double)(gv * gv);
        }
        ps += prs;
        RV[r] = lerp_like_torch(RV[r], (float)((double)rs / C), w);
      }
      psq[t] += ps;
    });
    for (int64_t b = 0; b < B; ++b)
      for (int64_t c = 0; c < C; ++c) {
        double s = 0.0;
        for (int t = 0; t < threads; ++t) s += colsum[((size_t)t * B + b) * C + c];
        CV[b * C + c] = lerp_like_torch(CV[b * C + c], (float)(s / R), w);
      }
    rowscale.resize(rows);  // per row: the divisor max(mean_r row_var, eps1) of its matrix
    for (int64_t b = 0; b < B; ++b) {
      double m = 0.0;
      for (int64_t r = 0; r < R; ++r) m += RV[b * R + r];
      const float mean = std::max((float)(m / R), (float)eps1);
      for (int64_t r = 0; r < R; ++r) rowscale[b * R + r] = mean;
    }
    // rsqrt(row_var * col_var / mean) = rsqrt(row_var / mean) * rsqrt(col_var) where no clamp
    // engages: a row whose smallest v is at least eps1^2 takes two multiplies per element
    rowinv.resize(rows); colinv.resize(B * C); colmin.assign(B, INFINITY);
    for (int64_t i = 0; i < B * C; ++i) {
      colinv[i] = CV[i] > 0.0f ? (float)(1.0 / std::sqrt((double)CV[i])) : 0.0f;
      colmin[i / C] = std::min(colmin[i / C], CV[i]);
    }
    for (int64_t r = 0; r < rows; ++r) rowinv[r] = (float)(1.0 / std::sqrt((double)RV[r] / rowscale[r]));
  } else {
    at::parallel_for(0, n, 4096, [&](int64_t i0, int64_t i1) {
      const int t = at::get_thread_num();
      float prs = 0.0f;
#pragma omp simd reduction(+:prs)
      for (int64_t i = i0; i < i1; ++i) {
        const float gv = G[i];
        prs += P[i] * P[i];
        V[i] = lerp_like_torch(V[i], gv * gv, w);
      }
      psq[t] += prs;
    });
  }
  double ps = 0.0;
  for (double v : psq) ps += v;
  const double alpha = std::max(eps2, std::sqrt(ps) / std::sqrt((double)n)) * rho;
  // u = g * rsqrt(max(v, eps1^2)), v as torch forms it: (row_var * col_var) / mean, or variance
  auto fast_row = [&](int64_t r) { return (RV[r] * colmin[r / R]) / rowscale[r] >= floor2; };
  auto row_of = [&](int64_t r, float& rv, float& mean, const float*& cv, const float*& vv) {
    if (factored) { rv = RV[r]; mean = rowscale[r]; cv = CV + (r / R) * C; vv = nullptr; }
    else { rv = 1.0f; mean = 1.0f; cv = nullptr; vv = V; }
  };
  // pass 2: ||u||^2
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    const int t = at::get_thread_num();
    double s = 0.0;
    for (int64_t r = r0; r < r1; ++r) {
      float rv, mean; const float* cv; const float* vv;
      row_of(r, rv, mean, cv, vv);
      const float* gr = G + r * C;
      float rsum = 0.0f;
      if (factored && fast_row(r)) {
        const float a = rowinv[r]; const float* bc = colinv.data() + (r / R) * C;
#pragma omp simd reduction(+:rsum)
        for (int64_t c = 0; c < C; ++c) { const float u = gr[c] * a * bc[c]; rsum += u * u; }
      } else if (factored) {
#pragma omp simd reduction(+:rsum)
        for (int64_t c = 0; c < C; ++c) {
          const float v = std::max((rv * cv[c]) / mean, floor2);
          const float u = gr[c] * (1.0f / std::sqrt(v));
          rsum += u * u;
        }
      } else {
#pragma omp simd reduction(+:rsum)
        for (int64_t c = 0; c < C; ++c) {
          const float u = gr[c] * (1.0f / std::sqrt(std::max(vv[c], floor2)));
          rsum += u * u;
        }
      }
      s += rsum;
    }
    usq[t] += s;
  });
  double us = 0.0;
  for (double v : usq) us += v;
  const double denom = std::max(1.0, std::sqrt(us) / (std::sqrt((double)n) * d));
  const float keep = (float)(1.0 - lr * weight_decay);
  const float scale = (float)(-alpha / denom);
  // pass 3: p = p * (1 - lr wd) + scale * u
  const bool decay = weight_decay != 0.0;
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float rv, mean; const float* cv; const float* vv;
      row_of(r, rv, mean, cv, vv);
      const float* gr = G + r * C;
      float* pr = P + r * C;
      if (factored && fast_row(r)) {
        const float a = rowinv[r]; const float* bc = colinv.data() + (r / R) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float pv = decay ? pr[c] * keep : pr[c];
          pr[c] = pv + scale * (gr[c] * a * bc[c]);
        }
      } else if (factored) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float v = std::max((rv * cv[c]) / mean, floor2);
          const float pv = decay ? pr[c] * keep : pr[c];
          pr[c] = pv + scale * (gr[c] * (1.0f / std::sqrt(v)));
        }
      } else {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const float pv = decay ? pr[c] * keep : pr[c];
          pr[c] = pv + scale * (gr[c] * (1.0f / std::sqrt(std::max(vv[c], floor2))));
        }
      }
    }
  });
}
"""

def load_adafactor_op(log: Log) -> ModuleType:
    """The compiled op, built into ``extensions_dir()`` at first use (one line said then). Raises
    whatever the build raises (no compiler, no ninja, ...)."""
    from torch.utils.cpp_extension import load_inline

    root, name = extensions_dir(), op_name()
    if not (root / name / f"{name}.so").exists():
        log(f"building m6's C++ host Adafactor ({name}) into {root} (once per machine and torch version, ~1 min)")
    return load_inline(name, cpp_sources=_SOURCE, functions=["adafactor_step"],
                       extra_cflags=["-O3", "-march=native", "-fno-math-errno", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def _eligible(p: torch.Tensor) -> bool:
    g = p.grad
    return (not isinstance(p, DTensor) and not isinstance(g, DTensor) and p.device.type == "cpu" and p.dtype == torch.float32 and g is not None and g.dtype == torch.float32
            and p.is_contiguous() and g.is_contiguous() and p.numel() > 0 and not g.is_sparse)


class HostAdafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor whose step runs m6's C++ op on every fp32 contiguous host tensor (the
    offloaded masters); any other tensor (another dtype or device, a DTensor shard, maximize) takes
    torch's step.
    Hyper-parameters, state and state_dict are torch's."""

    def __init__(self, params, op: ModuleType, **kwargs) -> None:
        super().__init__(params, foreach=True, **kwargs)
        self._op = op

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        rest: list[tuple[dict, list[torch.Tensor]]] = []
        for group in self.param_groups:
            if group["maximize"]:
                rest.append((group, [p for p in group["params"] if p.grad is not None]))
                continue
            eps1, eps2 = group["eps"]
            lr = float(group["lr"])
            others = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not _eligible(p):
                    others.append(p)
                    continue
                state = self.state[p]
                if len(state) == 0:  # torch's layout (Adafactor._init_group)
                    state["step"] = torch.tensor(0.0, dtype=torch.get_default_dtype())
                    if p.dim() > 1:
                        state["row_var"] = p.new_zeros((*p.shape[:-1], 1))
                        state["col_var"] = p.new_zeros((*p.shape[:-2], 1, p.shape[-1]))
                    else:
                        state["variance"] = torch.zeros_like(p)
                state["step"] += 1
                empty = torch.Tensor()
                self._op.adafactor_step(p, p.grad, state.get("row_var", empty), state.get("col_var", empty),
                                        state.get("variance", empty), float(state["step"]), lr,
                                        float(group["weight_decay"]), float(group["beta2_decay"]),
                                        torch.finfo(p.dtype).eps if eps1 is None else float(eps1), float(eps2),
                                        float(group["d"]))
            if others:
                rest.append((group, others))
        if rest:  # torch's own step on just these tensors: every group shows only them for it
            saved = [g["params"] for g in self.param_groups]
            todo = {id(g): params for g, params in rest}
            for g in self.param_groups:
                g["params"] = todo.get(id(g), [])
            try:
                super().step()
            finally:
                for g, params in zip(self.param_groups, saved):
                    g["params"] = params
        return loss


def probe_adafactor_op(log: Log, load: Optional[Callable[[Log], ModuleType]] = None) -> Optional[str]:
    """None when the op loads (building it if needed), else the gist of why not."""
    try:
        (load or load_adafactor_op)(log)
    except Exception as e:  # noqa: BLE001 - any failure of the build means: not available
        return error_gist(e)
    return None


def choose_host_adafactor(choice: str, failures: dict[int, str], log: Log) -> str:
    """"cpp" (m6's op) or "torch" for the host Adafactor under ``memory.host_optimizer`` = ``choice``
    (torch or auto; deepspeed is refused by config.py), given the ranks whose op failed (rank ->
    gist; every rank passes the same, so every rank chooses the same); the fallback said in one line."""
    if choice == "torch":
        return "torch"
    if not failures:
        log(f"memory.host_optimizer={choice}: the offloaded update runs m6's C++ Adafactor (m6.memory.host_adafactor)")
        return "cpp"
    rank, gist = min(failures.items())
    where = "" if list(failures) == [0] else f" on {len(failures)} rank(s), rank {rank}:"
    log(f"memory.host_optimizer={choice}: m6's C++ host Adafactor could not be built or loaded{where} ({gist}; "
        f"building it needs a C++ compiler and ninja); the offloaded update runs torch's foreach Adafactor instead")
    return "torch"


def build_host_adafactor(groups: list[dict], lr: float, host: str) -> torch.optim.Optimizer:
    """The host Adafactor ``host`` names: "cpp", m6's op (loaded: built by the probe), else torch's foreach."""
    if host == "cpp":
        return HostAdafactor(groups, load_adafactor_op(lambda _: None), lr=lr)
    assert host == "torch", host
    return torch.optim.Adafactor(groups, lr=lr, foreach=True)
