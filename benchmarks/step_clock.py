"""The steady speed of docs/scaling.md's supervised table (`bash benchmarks/gpu_supervised.sh` uses it): the speed
of a training loop, timed the same way whatever runs it (this repo's scripts through benchmarks/gpu_step.py, TRL's
trainers through benchmarks/trl_supervised.py): a global hook on every torch
optimizer's step waits for the device and notes the time after each optimizer step. The first `warmup` steps
are left out (on a GPU they hold CUDA's lazy kernel loading, cuBLAS's first calls and the caching allocator
growing, seconds that a 40-step run spreads over every step and a real run pays once): the steady speed is
samples/s from the end of step `warmup` to the end of the last step.

With `profile_steps` > 0 torch.profiler records the `profile_steps` steps after the warmup instead, in a run of
its own (the profiler slows what it records, so such a run's speed is not reported): the wall time per step,
the GPU's kernel time per step and their ratio (how busy the GPU was: well under 1, and the step waits on the
host, launching kernels one at a time), the kernels launched per step, the kernels that took longest, and the
operators whose kernels did (on the CPU, whose own time).

    clock = StepClock(warmup=10, profile_steps=0)   # before the trainer builds its optimizer
    ...                                              # train
    print(clock.report(batch_size))                  # {"steady_samples_per_second": ..., ...}
"""
import collections
import time

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


class StepClock:
    def __init__(self, warmup=10, profile_steps=0):
        self.warmup, self.profile_steps, self.times, self.profiler = warmup, profile_steps, [], None
        self.cuda = torch.cuda.is_available()
        self.handle = register_optimizer_step_post_hook(self.tick)  # handle.remove() takes it away

    def tick(self, optimizer, args, kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        if not self.profile_steps:
            return
        if len(self.times) == self.warmup:
            activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * self.cuda
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.start()
            self.profile_start = time.perf_counter()  # the profiler's own start is not a step's time
        elif len(self.times) == self.warmup + self.profile_steps and self.profiler is not None:
            self.profiler.stop()

    def report(self, batch_size):
        """The steady speed (or the profile), as a dict for a JSON line; an empty one if the run took no more than
        `warmup` steps."""
        steps = len(self.times) - self.warmup  # timed steps, after the end of step `warmup`
        if steps < 1 or self.warmup < 1:
            return {}
        if not self.profile_steps:
            return {"steady_samples_per_second": steps * batch_size / (self.times[-1] - self.times[self.warmup - 1]),
                    "steady_steps": steps, "warmup_steps": self.warmup}
        if steps < self.profile_steps:
            return {}
        wall = (self.times[self.warmup + self.profile_steps - 1] - self.profile_start) / self.profile_steps
        kernels = [e for e in self.profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        per_name = collections.Counter()
        for e in kernels:
            per_name[e.name] += e.time_range.elapsed_us()
        gpu = sum(per_name.values()) / 1e3 / self.profile_steps  # ms per step
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"  # µs, summed over the steps
        ops = sorted(self.profiler.key_averages(), key=lambda op: getattr(op, key), reverse=True)[:12]
        return {"profile": {
            "steps": self.profile_steps, "wall_ms_per_step": round(wall * 1e3, 2),
            "gpu_kernel_ms_per_step": round(gpu, 2) if self.cuda else None,
            "gpu_busy": round(gpu / (wall * 1e3), 3) if self.cuda else None,
            "kernels_per_step": round(len(kernels) / self.profile_steps) if self.cuda else None,
            "top_kernels_ms_per_step": [[name[:80], round(us / 1e3 / self.profile_steps, 2)]
                                        for name, us in per_name.most_common(12)],
            # the operators whose own kernels (on the CPU: own time) took longest, and their calls per step
            "top_ops_ms_per_step": [[op.key[:80], round(getattr(op, key) / 1e3 / self.profile_steps, 2),
                                     round(op.count / self.profile_steps, 1)] for op in ops]}}
