"""GPU assignment: replicas never share a GPU, tensor-parallel groups are contiguous and aligned."""

from __future__ import annotations

import itertools

import pytest

from proxy.fleet.gpus import (
    GpuAssignmentError,
    GpuDemand,
    GpuPool,
    detect_gpus,
    parse_cuda_visible_devices,
    parse_nvidia_smi_listing,
    plan_assignment,
)

EIGHT = [str(i) for i in range(8)]


def all_groups(plan: dict[str, list[list[str]]]) -> list[list[str]]:
    return [g for groups in plan.values() for g in groups]


def test_cuda_visible_devices_follows_cuda_rules():
    assert parse_cuda_visible_devices("0,1, 3") == ["0", "1", "3"]
    assert parse_cuda_visible_devices("") == []
    assert parse_cuda_visible_devices("-1") == []
    assert parse_cuda_visible_devices("2,-1,3") == ["2"]  # CUDA stops at the first invalid id
    assert parse_cuda_visible_devices("GPU-aa11,GPU-bb22") == ["GPU-aa11", "GPU-bb22"]


def test_nvidia_smi_listing_counts_whole_gpus_only():
    text = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\n"
            "  MIG 3g.40gb     Device  0: (UUID: MIG-1)\n"
            "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)\n")
    assert parse_nvidia_smi_listing(text) == ["0", "1"]


async def test_cuda_visible_devices_wins_over_nvidia_smi():
    gpus, source = await detect_gpus({"CUDA_VISIBLE_DEVICES": "4,5"})
    assert gpus == ["4", "5"] and "CUDA_VISIBLE_DEVICES" in source


def test_tensor_parallel_groups_are_contiguous_and_aligned():
    plan = plan_assignment([GpuDemand("small", 2, 1), GpuDemand("big", 1, 4), GpuDemand("mid", 1, 2)], EIGHT)
    assert plan["big"] == [["0", "1", "2", "3"]]
    assert plan["mid"] == [["4", "5"]]
    assert sorted(plan["small"]) == [["6"], ["7"]]


@pytest.mark.parametrize("sizes", [(1, 1, 1, 1, 1, 1, 1, 1), (2, 2, 2, 2), (4, 2, 1, 1), (1, 2, 1, 4), (8,),
                                   (2, 1, 2, 1, 2), (4, 4)])
def test_groups_never_overlap_and_match_sizes(sizes):
    demands = [GpuDemand(f"m{i}", 1, n) for i, n in enumerate(sizes)]
    plan = plan_assignment(demands, EIGHT)
    groups = all_groups(plan)
    used = [g for group in groups for g in group]
    assert len(used) == len(set(used)), f"overlap in {plan}"
    for i, n in enumerate(sizes):
        (group,) = plan[f"m{i}"]
        assert len(group) == n
        ids = [int(g) for g in group]
        assert ids == list(range(ids[0], ids[0] + n)), f"group {group} is not contiguous"
        assert ids[0] % n == 0, f"group {group} is not aligned to its size"


def test_every_fitting_mix_of_power_of_two_groups_is_placed():
    for combo in itertools.combinations_with_replacement([1, 2, 4, 8], 4):
        demands = [GpuDemand(f"m{i}", 1, n) for i, n in enumerate(combo)]
        if sum(combo) > 8:
            with pytest.raises(GpuAssignmentError):
                plan_assignment(demands, EIGHT)
        else:
            used = [g for group in all_groups(plan_assignment(demands, EIGHT)) for g in group]
            assert len(used) == len(set(used)) == sum(combo)


def test_visible_subset_is_used_as_given():
    plan = plan_assignment([GpuDemand("m", 2, 2)], ["4", "5", "6", "7"])
    assert plan["m"] == [["4", "5"], ["6", "7"]]


def test_too_big_a_fleet_is_refused_with_the_arithmetic():
    with pytest.raises(GpuAssignmentError) as err:
        plan_assignment([GpuDemand("qwen-vl-8b", 4, 2), GpuDemand("qwen-vl-2b", 2, 1)], EIGHT,
                        "CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7'")
    msg = str(err.value)
    assert "needs 10 GPUs" in msg and "8 are available" in msg
    assert "qwen-vl-8b: 4 x 2" in msg and "CUDA_VISIBLE_DEVICES" in msg


def test_no_gpus_at_all_is_refused_for_a_gpu_model():
    with pytest.raises(GpuAssignmentError, match="needs 1 GPUs .* but 0 are available"):
        plan_assignment([GpuDemand("m", 1, 1)], [])


def test_pool_allocates_around_held_gpus_and_releases_them():
    pool = GpuPool(EIGHT)
    assert pool.allocate(2, "a") == ["0", "1"]
    assert pool.allocate(1, "b") == ["2"]
    assert pool.allocate(2, "c") == ["4", "5"]  # 2-3 is not free: next aligned pair
    assert pool.allocate(1, "d") == ["3"]
    pool.release("a")
    assert pool.allocate(2, "e") == ["0", "1"]
    assert pool.can_allocate([2]) and not pool.can_allocate([4])


def test_pool_refuses_fragmented_tensor_parallel_group():
    pool = GpuPool(["0", "1", "2", "3"])
    pool.allocate(1, "a")
    pool.allocate(1, "b")
    pool.release("a")  # free: 0, 2, 3 -> three GPUs but no room for 3 adjacent
    with pytest.raises(GpuAssignmentError, match="not adjacent"):
        pool.allocate(3, "c")
    assert pool.allocate(2, "d") == ["2", "3"]


def test_zero_gpu_replicas_take_nothing():
    plan = plan_assignment([GpuDemand("cpu", 3, 0)], [])
    assert plan == {"cpu": [[], [], []]}
