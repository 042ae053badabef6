"""The Go core as a typed module: the functions of the one flavor :mod:`gograph.core._native`
loaded (``_core_cuda`` or ``_core_cpu``), re-exported here so that every call site is
``_core.name(...)`` and a type checker sees ``_core.pyi``. docs/CORE_API.md is the contract.

``raw_replay`` and ``raw_order_replay`` are the extension's C entry points of ``replay`` and
``order_replay`` (gopy's generated Python wrapper adds a Python-level call each), used on the
replay hot path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _native

#: The core version this Python package was written against (``core_version()`` must match).
EXPECTED_VERSION = "0.3.0"

NAMES = (
    "core_version",
    "flavor",
    "cuda_header_version",
    "driver_version",
    "device_count",
    "device_name",
    "device_total_memory",
    "trigger_panic_for_test",
    "begin_capture",
    "end_capture",
    "abort_capture",
    "capture_status",
    "exchange_capture_mode",
    "upload_graph",
    "launch_graph",
    "destroy_graph",
    "graph_node_count",
    "live_graphs",
    "new_pass",
    "begin_pass_capture",
    "end_pass_capture",
    "abort_pass_capture",
    "seal_pass",
    "replay",
    "order_replay",
    "pass_state",
    "pass_graph",
    "reset_pass",
    "pass_reset_error",
    "drop_pass",
    "pool_refs",
    "live_passes",
    "plan_schedule",
    "plan_steps",
    "plan_sample_entries",
    "pool_model_new",
    "pool_model_apply",
    "pool_model_free_ranges",
    "pool_model_drop",
    "live_pool_models",
    "plan_warmup",
    "plan_capture",
    "plan_memory",
    "simulate_pools",
    "grad_slot_policy",
    "free_plan",
    "live_plans",
    "capture_seq",
    "pass_pool",
    "set_replay_order_check",
    "check_replay_order",
    "replay_order_check",
    "discard_replay_order",
    "replay_order_state",
    "set_replay_recarve_spec",
    "replay_clobbers",
)


def _bind(module: Any) -> None:
    missing = [n for n in NAMES if not hasattr(module, n)]
    version = str(module.core_version()) if hasattr(module, "core_version") else "?"
    if missing or version != EXPECTED_VERSION:
        raise ImportError(
            f"gograph: the loaded Go core ({getattr(module, '__file__', module)}) is version {version}, but "
            f"this Python package needs {EXPECTED_VERSION} (missing: {', '.join(missing) or 'none'}); the "
            "extension is stale: rebuild it (`make build`, or `pip install .` again)"
        )
    for name in NAMES:
        globals()[name] = getattr(module, name)
    ext = getattr(module, "_gographcore", None)
    globals()["raw_replay"] = getattr(ext, "gograph_Replay", None) or module.replay
    globals()["raw_order_replay"] = getattr(ext, "gograph_OrderReplay", None) or module.order_replay


raw_replay: Callable[[int, int, int], bool]
raw_order_replay: Callable[[int, int, int], bool]
_bind(_native.core)
