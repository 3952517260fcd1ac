"""The minimal backend of docs/backends/writing-a-backend.md (``examples/thread_backend.py``) passes
the shared backend tests: test_group.py's tests that run on every backend run here on it too, but
one: its ranks run at once in one process, so they cannot each see their own RANK in os.environ
(self.rank and friends are right; that test checks the environment too)."""

from __future__ import annotations

import pytest
from repo_scripts import load_script

# The shared tests, collected here a second time: their ``backend`` fixtures are the ones below.
from test_group import (  # noqa: F401
    group,
    shared_group,
    test_all_to_all_gives_rank_i_entry_i,
    test_any_class_is_a_group,
    test_colocated_roles_reach_their_siblings_of_the_same_rank,
    test_colocated_roles_share_processes,
    test_constructor_error_is_a_worker_error,
    test_custom_dispatch_modes_by_object_name_and_dict,
    test_dp_compute_proto_any_batch_size_rows_in_order,
    test_dp_compute_proto_rows_in_order_on_other_world_sizes,
    test_dp_compute_proto_unpads_multi_sample_outputs,
    test_dp_compute_proto_with_func_and_metric,
    test_future_passed_into_another_groups_call,
    test_methods_are_discoverable_and_documented,
    test_non_blocking_call_returns_group_future,
    test_one_to_all_returns_one_result_per_rank,
    test_rank_zero_modes_return_rank_zero_result_only,
    test_shutdown_and_context_manager,
    test_trace_records_dispatch_execute_collect,
    test_worker_mutation_does_not_leak_into_caller,
)

import spmdcall as sc


@pytest.fixture(scope="module")
def thread_backend():
    module = load_script("examples/thread_backend.py", "thread_backend_example")
    sc.register_backend("threads", module.ThreadBackend, overwrite=True)
    return module.ThreadBackend


@pytest.fixture
def backend(thread_backend) -> str:
    return "threads"


@pytest.fixture(scope="module")
def module_backend(thread_backend) -> str:
    return "threads"


def test_it_is_a_backend_by_the_protocol(thread_backend):
    assert isinstance(thread_backend(), sc.Backend)
