"""Write a ``verl`` package that re-exports :mod:`spmdcall.compat.verl`, so code written against
verl's single controller runs on spmdcall without touching its imports.

    python -m spmdcall.compat.verl.shim DIR      # then: PYTHONPATH=DIR python my_verl_driver.py

The package has the modules verl code imports its single-controller and DataProto names from
(:data:`MODULES`), each made only of ``from spmdcall.compat.verl import ...``. It has no
``verl.utils`` or other verl subpackage: ``verl/utils`` may be copied in from a verl checkout next
to it (``make verl-compat`` does, to run verl's own tests).
"""

from __future__ import annotations

import argparse
from pathlib import Path

_DATA = ["DataProto", "DataProtoItem", "DataProtoFuture", "DataProtoConfig", "pad_dataproto_to_divisor"]
_DATA += ["unpad_dataproto", "union_tensor_dict", "union_numpy_dict", "fold_batch_dim", "unfold_batch_dim"]
_DATA += [
    "serialize_single_tensor",
    "deserialize_single_tensor",
    "serialize_tensordict",
    "deserialize_tensordict",
]
_BASE = ["Worker", "WorkerGroup", "ClassWithInitArgs", "ResourcePool"]
_DECORATOR = ["Dispatch", "Execute", "register", "register_dispatch_mode", "update_dispatch_mode"]
_DECORATOR += ["get_predefined_dispatch_fn", "_check_dispatch_mode", "DISPATCH_MODE_FN_REGISTRY"]
_DECORATOR += ["make_nd_compute_dataproto_dispatch_fn", "dispatch_one_to_all", "dispatch_all_to_all"]
_DECORATOR += [
    "dispatch_dp_compute",
    "dispatch_dp_compute_data_proto",
    "dispatch_dp_compute_data_proto_with_func",
]
_DECORATOR += ["collect_all_to_all", "collect_dp_compute", "collect_dp_compute_data_proto"]
_RAY = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "create_colocated_worker_cls"]
_RAY += ["create_colocated_worker_cls_fused"]

# verl module -> the names it re-exports from spmdcall.compat.verl.
MODULES: dict[str, list[str]] = {
    "verl": ["DataProto"],
    "verl.protocol": _DATA,
    "verl.single_controller": _BASE,
    "verl.single_controller.base": _BASE,
    "verl.single_controller.base.worker": ["Worker"],
    "verl.single_controller.base.worker_group": ["WorkerGroup", "ClassWithInitArgs", "ResourcePool"],
    "verl.single_controller.base.decorator": _DECORATOR,
    "verl.single_controller.ray": _RAY,
    "verl.single_controller.ray.base": [*_RAY, "merge_resource_pool", "split_resource_pool"]
    + ["create_colocated_worker_raw_cls", "Worker"],
}


def write_shim(directory: str | Path) -> Path:
    """Write the ``verl`` package into ``directory`` (created if needed) and return its path.

    Example:
        >>> import tempfile; write_shim(tempfile.mkdtemp()).name
        'verl'
    """
    root = Path(directory)
    for module, names in MODULES.items():
        path = root.joinpath(*module.split("."), "__init__.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        public = [n for n in names if not n.startswith("_")]
        path.write_text(
            f'"""{module}: names from spmdcall.compat.verl (written by spmdcall.compat.verl.shim)."""\n\n'
            f"from spmdcall.compat.verl import {', '.join(names)}  # noqa: F401\n\n"
            f"__all__ = {public!r}\n"
        )
    return root / "verl"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", help="where to write the verl package")
    print(write_shim(parser.parse_args(argv).directory))


if __name__ == "__main__":
    main()
