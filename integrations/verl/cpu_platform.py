"""A CPU platform for verl, registered through verl's own plugin API (``PlatformRegistry``, ``VERL_PLATFORM``).

verl 0.9.1 registers only accelerator platforms (nvidia, ascend, rocm) and falls back to ``nvidia`` when none is
found, so on a CPU-only machine its FSDP engine would call ``torch.cuda.set_device``. This is the missing CPU entry
(the hook verl documents for new devices, ``verl/plugin/platform/platform_base.py``); no verl class is patched.
``device_module`` answers the few accelerator queries verl's workers make (memory figures, seeding, caches).
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

CPU_DEVICE = types.SimpleNamespace(
    is_available=lambda: True,
    device_count=lambda: 1,
    current_device=lambda: "cpu",
    set_device=lambda *_: None,
    synchronize=lambda *_: None,
    empty_cache=lambda: None,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    max_memory_allocated=lambda *_: 0,
    max_memory_reserved=lambda *_: 0,
    memory_allocated=lambda *_: 0,
    memory_reserved=lambda *_: 0,
    reset_peak_memory_stats=lambda *_: None,
    mem_get_info=lambda *_: (0, 0),
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    ipc_collect=lambda: None,
    get_device_name=lambda *_: "CPU",
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = CPU_DEVICE

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def nvtx_range(self, msg: str):
        return contextlib.nullcontext()

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def use_cpu_platform() -> None:
    """Select the CPU platform for this process (before verl first asks for its platform)."""
    os.environ["VERL_PLATFORM"] = "cpu"
    # verl registers its FSDP engine for device "cuda"/"npu" only; its own override picks that (device-agnostic) class.
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
