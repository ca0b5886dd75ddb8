"""Flow-matching samplers with precomputed per-step coefficients, so the N-step loop can replay as a CUDA graph.

Two schedulers, each reproducing a diffusers class step for step (diffusers is only their test oracle):
`FlowEulerScheduler` ~ FlowMatchEulerDiscreteScheduler and `UniPCScheduler` ~ UniPCMultistepScheduler with
prediction_type="flow_prediction", the sampler the MiniMax-Remover / Wan2.1 checkpoints ship.

Two schedules (`SCHEDULES`, the `schedule` argument; RunOptions.schedule / --schedule):
- "minimax-remover" (the default): UniPC's flow schedule as diffusers 0.33.1 builds it, the release the MiniMax-Remover
  code pins (its requirements.txt): the sigmas and timesteps of the released pipeline, exactly, for every step count.
- "diffusers": UniPC's flow schedule as diffusers 0.37 and later build it (other sigmas and timesteps; see
  `_unipc_schedule`).
Only UniPC's flow schedule changed between those releases: FlowMatchEulerDiscreteScheduler builds the same one in
both, so the two names give the same Euler schedule. The step arithmetic is the same for both schedules (diffusers
0.38+'s: coefficients computed on the run device; 0.33.1 computed them on the host, which on a GPU can round the last
bit differently).

The math
--------
Flow matching mixes data x0 and noise e as  x = (1 - s) * x0 + s * e,  with the noise level s ("sigma") going from
about 1 down to 0, and the transformer predicts the velocity v = e - x0. So any sample gives an x0 prediction
x0 = x - s * v.

Euler:  x_{i+1} = x_i + (s_{i+1} - s_i) * v_i.

UniPC (Zhao et al. 2023, arXiv:2302.04867), "B(h)" variant, data-prediction form. With a = 1 - s and the log
signal-to-noise ratio l = log(a / s), one update from level s0 to level t (h = l_t - l_s0 > 0) is

    x_t = (s_t / s_s0) * x_s0 - a_t * (e^-h - 1) * m0 - a_t * B(h) * sum_k rho_k * (m_k - m0) / r_k

where m0 is the newest x0 prediction, m_k the k-th older one (made at level s_k), r_k = (l_sk - l_s0) / h,
B(h) = -h ("bh1") or e^-h - 1 ("bh2"), and rho solves a small Vandermonde system R rho = b built from the r_k and
phi-functions of h.
- Predictor (UniP), at step i: the update from s_i to s_{i+1} using m0 = x0 of step i and q_i - 1 older ones.
  Its result is the model input of step i + 1.
- Corrector (UniC), at the start of step i + 1: with the fresh x0 prediction m_t of that input, the same update
  from s_i is redone with one more term, rho_last * (m_t - m0) (r = 1); its result replaces the input before the
  next predictor. It costs no model call.
Every s, r_k, rho_k and B(h) depends only on the schedule, so they are all computed here, once, and stored as
device tensors; `step(i, ...)` is then a fixed linear combination of model_output, sample and at most
`solver_order` earlier x0 predictions, with no host work.

UniPC's coefficients are computed the way diffusers computes them inside `step`: float32 torch ops on 0-dim tensors,
in the same order, on the device the scheduler is built for (CUDA's log/expm1/solve round differently from the CPU's
in the last bit, and order-3 solves amplify that). Float64 would be more accurate but would not reproduce diffusers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch

from fastremover.errors import FastRemoverError
from fastremover.options import SCHEDULES

# scheduler/scheduler_config.json of the MiniMax-Remover (and Wan2.1) checkpoints.
DEFAULT_SCHEDULER_CONFIG: dict = {
    "_class_name": "UniPCMultistepScheduler",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "disable_corrector": [],
    "dynamic_thresholding_ratio": 0.995,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "rescale_betas_zero_snr": False,
    "sample_max_value": 1.0,
    "solver_order": 2,
    "solver_p": None,
    "solver_type": "bh2",
    "steps_offset": 0,
    "thresholding": False,
    "timestep_spacing": "linspace",
    "trained_betas": None,
    "use_beta_sigmas": False,
    "use_exponential_sigmas": False,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
}

UNIPC = "UniPCMultistepScheduler"
EULER = "FlowMatchEulerDiscreteScheduler"

#: The flow schedules `build_scheduler` builds (see the module docstring); the first is the default.
DEFAULT_SCHEDULE = SCHEDULES[0]


# ----------------------------------------------------------------------------------------------------------------
# config: read, check against diffusers' defaults, reject what we would silently get wrong


def load_scheduler_config(folder_or_file: str | Path) -> dict:
    """Read scheduler_config.json (given its folder or the file itself); without one, the default UniPC config."""
    path = Path(folder_or_file)
    if path.is_dir():
        path = path / "scheduler_config.json"
    if not path.exists():
        return copy.deepcopy(DEFAULT_SCHEDULER_CONFIG)
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FastRemoverError(
            f"cannot read the scheduler config {path}: {e}. Fix the file, or delete it to use the default "
            "MiniMax-Remover UniPC scheduler."
        ) from e
    if not isinstance(config, dict):
        raise FastRemoverError(
            f"the scheduler config {path} holds a JSON {type(config).__name__}, not an object. Fix the file, or "
            "delete it to use the default MiniMax-Remover UniPC scheduler."
        )
    _resolve_options(config, source=str(path))
    return config


def _resolve_options(config: dict, source: str) -> dict:
    """The options that shape the schedule, with diffusers' defaults for missing keys; FastRemoverError for values
    we do not run. Keys that cannot change the result (e.g. "_diffusers_version", the beta_* of a flow schedule)
    are ignored, as diffusers ignores them."""
    name = config.get("_class_name")
    if name not in (UNIPC, EULER):
        raise FastRemoverError(
            f"{source}: scheduler _class_name {name!r} is not supported; fastremover runs {UNIPC!r} and {EULER!r}. "
            "Use the scheduler folder of a MiniMax-Remover / Wan2.1 checkpoint, or no scheduler config at all for "
            "the default UniPC scheduler."
        )
    opts = _Options(config, source, name)
    if name == UNIPC:
        # Options whose only supported value is diffusers' flow-matching UniPC path.
        opts.choice("prediction_type", "epsilon", ("flow_prediction",))
        opts.choice("use_flow_sigmas", False, (True,))
        opts.choice("predict_x0", True, (True,))
        opts.choice("thresholding", False, (False,))
        opts.choice("solver_p", None, (None,))
        opts.choice("use_dynamic_shifting", False, (False,), why="it needs a per-call `mu`")
        # timestep_spacing and steps_offset shape only non-flow schedules; diffusers still checks the spacing name.
        opts.choice("timestep_spacing", "linspace", ("linspace", "leading", "trailing"))
        solver_type = opts.choice("solver_type", "bh2", ("bh1", "bh2", "midpoint", "heun", "logrho"))
        resolved = {
            "num_train_timesteps": opts.number("num_train_timesteps", 1000, integer=True),
            "flow_shift": opts.number("flow_shift", 1.0),
            "shift_terminal": opts.shift_terminal(),
            "solver_order": opts.number("solver_order", 2, integer=True),
            # diffusers quietly runs its DPM-Solver names as bh2.
            "solver_type": solver_type if solver_type == "bh1" else "bh2",
            "lower_order_final": opts.choice("lower_order_final", True, (True, False)),
            "disable_corrector": opts.int_list("disable_corrector"),
            "final_sigmas_type": opts.choice("final_sigmas_type", "zero", ("zero", "sigma_min")),
        }
    else:
        opts.choice("use_dynamic_shifting", False, (False,), why="it needs a per-call `mu`")
        opts.choice("invert_sigmas", False, (False,))
        opts.choice("stochastic_sampling", False, (False,))
        # Only used by dynamic shifting, which we reject; diffusers still checks the name.
        opts.choice("time_shift_type", "exponential", ("exponential", "linear"))
        resolved = {
            "num_train_timesteps": opts.number("num_train_timesteps", 1000, integer=True),
            "shift": opts.number("shift", 1.0),
            "shift_terminal": opts.shift_terminal(),
        }
    for key in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas"):
        opts.choice(key, False, (False,))
    return resolved


class _Options:
    """Reads one option at a time from a scheduler config, raising a FastRemoverError that names the key."""

    def __init__(self, config: dict, source: str, class_name: str):
        self.config, self.source, self.class_name = config, source, class_name

    def _reject(self, key: str, value, supported: str, why: str = "") -> FastRemoverError:
        given = f"{key}={value!r}" + ("" if key in self.config else " (diffusers' default, the key is missing)")
        reason = f" ({why})" if why else ""
        return FastRemoverError(
            f"{self.source}: {self.class_name} option {given} is not supported{reason}; fastremover supports "
            f"{supported}. Change it in the scheduler config, or drop the config to use the default UniPC scheduler."
        )

    def choice(self, key: str, default, allowed: tuple, why: str = ""):
        value = self.config.get(key, default)
        # `type(...)` keeps 1 from passing for True and 0 for False.
        if not any(value == a and type(value) is type(a) for a in allowed):
            raise self._reject(key, value, " or ".join(repr(a) for a in allowed), why)
        return value

    def number(self, key: str, default: float, integer: bool = False) -> float:
        value = self.config.get(key, default)
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
            raise self._reject(key, value, "a positive " + ("integer" if integer else "number"))
        return value

    def shift_terminal(self) -> float | None:
        value = self.config.get("shift_terminal")
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            raise self._reject("shift_terminal", value, "null or a number between 0 and 1")
        return value

    def int_list(self, key: str) -> list[int]:
        value = self.config.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise self._reject(key, value, "a list of step indices")
        return list(value)


def check_schedule(schedule: str) -> str:
    """`schedule` if it is one of SCHEDULES, else a FastRemoverError naming the choices."""
    if schedule not in SCHEDULES:
        raise FastRemoverError(f"--schedule {schedule!r}: choose one of {list(SCHEDULES)}")
    return schedule


def build_scheduler(config: dict | None, num_steps: int, device: str | torch.device = "cpu",
                    schedule: str = DEFAULT_SCHEDULE) -> Scheduler:
    """The scheduler that config["_class_name"] names, set up for `num_steps` steps with `schedule` (SCHEDULES);
    config None means the default."""
    if config is None:
        config = DEFAULT_SCHEDULER_CONFIG
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise FastRemoverError(f"the number of denoising steps must be a positive integer, got {num_steps!r}")
    check_schedule(schedule)
    options = _resolve_options(config, source="scheduler config")
    if config["_class_name"] == EULER:
        return FlowEulerScheduler(options, num_steps, torch.device(device))
    if schedule == "minimax-remover" and options["shift_terminal"]:
        raise FastRemoverError(
            "scheduler config: shift_terminal is not part of diffusers 0.33.1's UniPC (the minimax-remover schedule); "
            "use --schedule diffusers, or drop shift_terminal from the scheduler config"
        )
    return UniPCScheduler(options, num_steps, torch.device(device), schedule)


# ----------------------------------------------------------------------------------------------------------------
# schedulers


def _scaled(coef: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """coef * x rounded once to x.dtype, coef kept in float32.

    This is what CUDA computes when diffusers' UniPC multiplies a low-precision tensor by a *CPU* 0-dim tensor (its
    `self.sigmas[i]`, kept on the CPU): the scalar enters the float32 math unrounded. A device 0-dim float32 tensor,
    like every other coefficient here and in diffusers, is instead rounded to x.dtype first. (PyTorch's CPU kernels
    round the CPU scalar too, so diffusers' fp16 UniPC numbers on the CPU differ from its CUDA ones by about one fp16
    rounding; we follow CUDA.) For float32 x this is plainly coef * x.
    """
    return (x.float() * coef).to(x.dtype)


def _stretch_to_terminal(sigmas: np.ndarray, shift_terminal: float) -> np.ndarray:
    """Rescale 1 - sigma so the schedule ends at `shift_terminal` (LTX-Video's shift_terminal, as in diffusers)."""
    one_minus = 1 - sigmas
    return 1 - one_minus / (one_minus[-1] / (1 - shift_terminal))


class Scheduler:
    """N-step flow-matching sampler. Call reset() before each denoising run, then step(i, ...) for i = 0..N-1."""

    num_steps: int
    timesteps: torch.Tensor  # [N] float32: the timestep the transformer sees at step i
    sigmas: torch.Tensor  # [N + 1] float32: noise level before step i; sigmas[N] is the final one

    def to(self, device: str | torch.device) -> Scheduler:
        """Move every schedule tensor to `device` and clear the multistep history. (UniPC's coefficients keep the
        values computed on the device it was built for.)"""
        self.reset()
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def reset(self) -> None:
        """Clear the multistep history."""

    def step(self, i: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The sample after step i, given the model's velocity prediction for `sample` at timesteps[i]."""
        raise NotImplementedError

    def describe(self) -> dict:
        """The diffusers class this reproduces and the options that shape the schedule."""
        raise NotImplementedError


class FlowEulerScheduler(Scheduler):
    """diffusers' FlowMatchEulerDiscreteScheduler: x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v_i."""

    def __init__(self, options: dict, num_steps: int, device: torch.device):
        self.options = options
        self.num_steps = num_steps
        n_train, shift = options["num_train_timesteps"], options["shift"]

        # diffusers takes the end points of the schedule from its (already shifted) 1000-entry training table in
        # float32, spaces timesteps linearly between them, and shifts again: the last sigma is shifted twice.
        table_ends = torch.tensor([float(n_train), 1.0]) / n_train
        table_ends = shift * table_ends / (1 + (shift - 1) * table_ends)
        sigma_max, sigma_min = table_ends.tolist()
        sigmas = np.linspace(sigma_max * n_train, sigma_min * n_train, num_steps) / n_train
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        if options["shift_terminal"]:
            sigmas = _stretch_to_terminal(sigmas, options["shift_terminal"])
        sigmas = torch.from_numpy(sigmas).float()

        self.timesteps = sigmas * n_train
        self.sigmas = torch.cat([sigmas, torch.zeros(1)])
        self.dt = self.sigmas[1:] - self.sigmas[:-1]  # [N] float32, as diffusers subtracts them
        self.to(device)  # the float32 ops above are exactly rounded, so the values do not depend on the device

    def step(self, i: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        # Rounding points, as in diffusers: sample is upcast to float32; dt * v is a v.dtype product (dt, a device
        # 0-dim float32 tensor like diffusers' once the pipeline gives set_timesteps a device, is rounded to v.dtype
        # first); the sum is float32; the result is cast to v.dtype.
        return (sample.float() + self.dt[i] * model_output).to(model_output.dtype)

    def describe(self) -> dict:
        return {"scheduler": EULER, "num_steps": self.num_steps, **self.options}


class UniPCScheduler(Scheduler):
    """diffusers' UniPCMultistepScheduler for flow prediction (predict_x0=True), B(h) predictor + corrector.

    Build it on the device it will run on: its coefficients are computed there, as diffusers computes them.
    """

    def __init__(self, options: dict, num_steps: int, device: torch.device, schedule: str = DEFAULT_SCHEDULE):
        self.options = options
        self.num_steps = num_steps
        self.schedule = check_schedule(schedule)
        self.solver_order = order = options["solver_order"]
        n = num_steps

        sigmas, timesteps = _unipc_schedule(options, n, schedule)
        self.sigmas, self.timesteps = sigmas.to(device), timesteps.to(device)

        # Order of the predictor at step i: warm up from 1, and with lower_order_final wind down to 1 at the end.
        self.predictor_order = [min(order, i + 1, n - i if options["lower_order_final"] else order) for i in range(n)]
        # Step i > 0 first corrects its input with the order of the predictor that made it.
        self.corrector_order = [
            0 if i == 0 or i - 1 in options["disable_corrector"] else self.predictor_order[i - 1] for i in range(n)
        ]
        _check_last_step(options, self.predictor_order[-1])

        # Computed on `device` from here on, as diffusers computes them there.
        lambdas = [torch.log(1 - s) - torch.log(s) for s in self.sigmas]  # log(alpha / sigma); +inf at sigma = 0
        width = max(order - 1, 1)
        # Per step: [s_t / s_s0, a_t * (e^-h - 1), a_t * B(h)], the r_k of the older predictions, and the rho_k.
        self.pred_coef = torch.zeros(n, 3, device=device)
        self.pred_rk, self.pred_rho = torch.ones(n, width, device=device), torch.zeros(n, width, device=device)
        self.corr_coef = torch.zeros(n, 3, device=device)
        self.corr_rk, self.corr_rho = torch.ones(n, width, device=device), torch.zeros(n, order, device=device)
        for i in range(n):
            q = self.predictor_order[i]
            coef, rks, rhos = _bh_coefficients(self.sigmas, lambdas, i + 1, i, range(i - 1, i - q, -1), options, False)
            self.pred_coef[i], self.pred_rk[i, : q - 1], self.pred_rho[i, : q - 1] = coef, rks, rhos
            p = self.corrector_order[i]
            if p:
                older = range(i - 2, i - 1 - p, -1)
                coef, rks, rhos = _bh_coefficients(self.sigmas, lambdas, i, i - 1, older, options, True)
                self.corr_coef[i], self.corr_rk[i, : p - 1], self.corr_rho[i, :p] = coef, rks, rhos
        self.reset()

    def reset(self) -> None:
        self.x0_history: list[torch.Tensor] = []  # the last `solver_order` x0 predictions, newest last
        self.last_sample: torch.Tensor | None = None  # the input of the last predictor
        self.steps_done = 0

    def step(self, i: int, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        if i != self.steps_done:
            raise RuntimeError(f"UniPC steps must run in order after reset(): expected step {self.steps_done}, got {i}")
        self.steps_done += 1
        x0 = sample - _scaled(self.sigmas[i], model_output)
        p = self.corrector_order[i]
        if p:
            sample = _bh_update(
                self.last_sample, self.x0_history, self.corr_coef[i], self.corr_rk[i], self.corr_rho[i, :p], p, x0
            )
        self.x0_history = (self.x0_history + [x0])[-self.solver_order :]
        self.last_sample = sample
        q = self.predictor_order[i]
        return _bh_update(sample, self.x0_history, self.pred_coef[i], self.pred_rk[i], self.pred_rho[i, : q - 1], q)

    def describe(self) -> dict:
        return {"scheduler": UNIPC, "num_steps": self.num_steps, "schedule": self.schedule, **self.options}


def released_unshifted_sigmas(num_train_timesteps: int, num_steps: int) -> np.ndarray:
    """The unshifted flow sigmas [N] (float64) of diffusers 0.33.1's UniPC: reversed(1 - linspace(1, 1/1000, N + 1))
    without its final 0. Shifted, they are that release's schedule; given to diffusers 0.38+'s
    `set_timesteps(sigmas=...)` (which shifts them the same way) they reproduce it there (bench.reference)."""
    return np.flip(1.0 - np.linspace(1, 1 / num_train_timesteps, num_steps + 1))[:-1].copy()


def _unipc_schedule(options: dict, num_steps: int, schedule: str = DEFAULT_SCHEDULE
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """sigmas [N + 1] and timesteps [N], float32, as diffusers' set_timesteps makes them for flow sigmas.

    "diffusers" (diffusers 0.37 and later): shift(linspace(1, 1/1000, N + 1)[:-1]), the first sigma nudged below 1.
    "minimax-remover" (diffusers 0.33.1 to 0.36): flip(shift(1 - linspace(1, 1/1000, N + 1)))[:-1], no nudge: every
    sigma but the last differs (12 steps: 0.999666 ... 0.214102 against 0.999999 ... 0.216303), and so does the sample
    for the same checkpoint and seed. The reference reproduces either on diffusers >= 0.38
    (bench.reference.MIN_DIFFUSERS)."""
    n_train, shift = options["num_train_timesteps"], options["flow_shift"]
    if schedule == "minimax-remover":
        sigmas = released_unshifted_sigmas(n_train, num_steps)
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    else:
        sigmas = np.linspace(1, 1 / n_train, num_steps + 1)[:-1]
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        if options["shift_terminal"]:
            sigmas = _stretch_to_terminal(sigmas, options["shift_terminal"])
        if abs(sigmas[0] - 1) < 1e-6:
            sigmas[0] -= 1e-6  # keeps log(sigma / alpha) finite
    # diffusers stores the timesteps as int64, truncating sigma * 1000 (999.999 -> 999); the values are exact here.
    timesteps = torch.from_numpy((sigmas * n_train).astype(np.int64)).float()
    last = sigmas[-1] if options["final_sigmas_type"] == "sigma_min" else 0.0
    return torch.from_numpy(np.append(sigmas, last).astype(np.float32)), timesteps


def _check_last_step(options: dict, last_order: int) -> None:
    """Reject the two endings on which diffusers' UniPC returns inf or NaN instead of a sample."""
    if options["final_sigmas_type"] == "zero" and last_order > 1:
        # Into sigma = 0, h = inf, so every r_k = 0 and (m_k - m0) / r_k overflows.
        raise FastRemoverError(
            "UniPC with lower_order_final=false and final_sigmas_type='zero' ends on a multistep update into sigma=0, "
            "which divides by zero (diffusers returns inf). Set lower_order_final to true or final_sigmas_type to "
            "'sigma_min', or use solver_order 1."
        )
    if options["final_sigmas_type"] == "sigma_min" and last_order > 2:
        # The last step repeats the final sigma, h = 0, and the order >= 3 system is 0/0.
        raise FastRemoverError(
            "UniPC with lower_order_final=false, final_sigmas_type='sigma_min' and solver_order>=3 ends on a 0/0 "
            "update (diffusers returns NaN). Set lower_order_final to true or solver_order to at most 2."
        )


def _bh_coefficients(
    sigmas: torch.Tensor, lambdas: list[torch.Tensor], t: int, s0: int, older: range, options: dict, corrector: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One B(h) update from sigmas[s0] to sigmas[t] using the x0 predictions made at levels `older` (newest
    first): ([s_t / s_s0, a_t * (e^-h - 1), a_t * B(h)], r_k per older prediction, rho_k). The corrector has one
    rho more, for the new prediction (r = 1). Float32 ops in diffusers' order, so the values match it exactly."""
    order, device = len(older) + 1, sigmas.device
    alpha_t = 1 - sigmas[t]
    h = lambdas[t] - lambdas[s0]
    rks = [(lambdas[s] - lambdas[s0]) / h for s in older]
    hh = -h  # data prediction integrates in -lambda
    h_phi_1 = torch.expm1(hh)  # e^-h - 1
    b_h = hh if options["solver_type"] == "bh1" else torch.expm1(hh)

    # R[k] = r^k over (r_1, ..., r_{order-1}, 1); b[k] = k! * phi_{k+1}(-h) / B(h).
    r = torch.stack([*rks, torch.ones((), device=device)])
    h_phi_k = h_phi_1 / hh - 1
    factorial = 1
    rows, b = [], []
    for k in range(1, order + 1):
        rows.append(torch.pow(r, k - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    R, b = torch.stack(rows), torch.stack(b)

    if corrector:
        # UniC-1 uses rho = 1/2 rather than the solve, as diffusers does.
        rhos = torch.full((1,), 0.5, device=device) if order == 1 else torch.linalg.solve(R, b)
    elif order <= 2:
        # UniP-2 likewise takes rho = 1/2; UniP-1 has no older terms.
        rhos = torch.full((order - 1,), 0.5, device=device)
    else:
        rhos = torch.linalg.solve(R[:-1, :-1], b[:-1])
    coef = torch.stack([sigmas[t] / sigmas[s0], alpha_t * h_phi_1, alpha_t * b_h])
    return coef, torch.stack(rks) if rks else torch.ones(0, device=device), rhos


def _bh_update(
    x: torch.Tensor,
    x0_history: list[torch.Tensor],
    coef: torch.Tensor,
    rks: torch.Tensor,
    rhos: torch.Tensor,
    order: int,
    new_x0: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_t = c_x * x - c_m0 * m0 - c_b * (sum_k rho_k * (m_k - m0) / r_k [+ rho_last * (new_x0 - m0)]).

    Rounding points, as in diffusers: each 0-dim coefficient (a float32 device tensor in both) is rounded to the
    dtype of the tensor it multiplies; every product, difference and the einsum are rounded to their tensors'
    dtype; rho is cast to x's dtype first; the result is cast to x's dtype.
    """
    m0 = x0_history[-1]
    rhos = rhos.to(x.dtype)
    out = coef[0] * x - coef[1] * m0
    diffs = [(x0_history[-2 - k] - m0) / rks[k] for k in range(order - 1)]
    if new_x0 is None:  # predictor
        if diffs:
            out = out - coef[2] * torch.einsum("k,bkc...->bc...", rhos, torch.stack(diffs, dim=1))
    else:  # corrector
        correction = rhos[-1] * (new_x0 - m0)
        if diffs:
            correction = torch.einsum("k,bkc...->bc...", rhos[:-1], torch.stack(diffs, dim=1)) + correction
        out = out - coef[2] * correction
    return out.to(x.dtype)
