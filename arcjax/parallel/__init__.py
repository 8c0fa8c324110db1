"""Tensor parallelism over a device mesh and multi-host serving (see layout.py, multihost.py).

`TensorParallel.create(cfg, tp)`: mesh + logical-axis rules; shardings derived from the specs
of `arcjax.model.specs`. `initialize(...)`, `StepSync`, `follow`, `stop_followers`: one process
per host, process 0 admits, every process runs the same plans (checked by digest each step).
"""

from arcjax.parallel.layout import (TENSOR_AXES, TP_AXIS, TensorParallel, check_tensor_parallel,
                                    kv_repeat, logical_rules, make_mesh, per_device_bytes,
                                    sharded_config)
from arcjax.parallel.multihost import (CoordinatorTransport, FollowerStop, LocalTransport,
                                       PlanDivergenceError, StepSync, follow, initialize,
                                       plan_digest, stop_followers)

__all__ = ["CoordinatorTransport", "FollowerStop", "LocalTransport", "PlanDivergenceError",
           "StepSync", "TENSOR_AXES", "TP_AXIS", "TensorParallel", "check_tensor_parallel",
           "follow", "initialize", "kv_repeat", "logical_rules", "make_mesh",
           "per_device_bytes", "plan_digest", "sharded_config",
           "stop_followers"]
