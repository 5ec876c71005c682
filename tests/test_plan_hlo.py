"""jaxrl.plan.hlo: collectives and Pallas kernels read from compiled HLO text.

Hand-written HLO covers the printed forms (async start/done pairs, tuples, replica-group syntaxes, loop
conditions); small programs compiled ahead of time for v5e:2x2 and v5p:2x2x2 check the parse against what each
program must communicate."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes on this machine may hold libtpu

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl.plan import hlo


# ---------------------------------------------------------------------------------------------------------------
# Hand-written HLO
# ---------------------------------------------------------------------------------------------------------------

def module(*computations: str, partitions: int = 4) -> str:
    return (f"HloModule m, is_scheduled=true, num_partitions={partitions}\n\n" + "\n\n".join(computations) + "\n")


ASYNC_ENTRY = """ENTRY %main (p0: bf16[8,128], p1: f32[4]) -> (bf16[32,128], f32[16], f32[4], f32[4]) {
  %p0 = bf16[8,128]{1,0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %all-gather-start = ((bf16[8,128]{1,0}, f32[4]{0}), (bf16[32,128]{1,0}, f32[16]{0})) all-gather-start(bf16[8,128]{1,0} %p0, f32[4]{0} %p1), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, use_global_device_ids=true
  %all-gather-done = (bf16[32,128]{1,0}, f32[16]{0}) all-gather-done(((bf16[8,128]{1,0}, f32[4]{0}), (bf16[32,128]{1,0}, f32[16]{0})) %all-gather-start)
  %all-reduce-start = f32[4]{0} all-reduce-start(f32[4]{0} %p1), channel_id=2, replica_groups=[2,2]<=[4], use_global_device_ids=true, to_apply=%add
  %all-reduce-done = f32[4]{0} all-reduce-done(f32[4]{0} %all-reduce-start)
  %collective-permute-start = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(f32[4]{0} %p1), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %collective-permute-done = f32[4]{0} collective-permute-done((f32[4]{0}, f32[4]{0}, u32[], u32[]) %collective-permute-start)
  %gte0 = bf16[32,128]{1,0} get-tuple-element(%all-gather-done), index=0
  %gte1 = f32[16]{0} get-tuple-element(%all-gather-done), index=1
  ROOT %t = (bf16[32,128]{1,0}, f32[16]{0}, f32[4]{0}, f32[4]{0}) tuple(%gte0, %gte1, %all-reduce-done, %collective-permute-done)
}"""

ADD = """%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}"""


def test_async_start_done_pairs_are_one_op_each_with_the_done_shape():
    found = hlo.collectives(module(ADD, ASYNC_ENTRY))
    assert [c.kind for c in found] == ["all-gather", "all-reduce", "collective-permute"]
    gather, reduce, permute = found
    assert gather.shape == "(bf16[32,128], f32[16])"  # the outputs of the combined gather, not its operands
    assert gather.bytes == 32 * 128 * 2 + 16 * 4
    assert gather.group_size == 4 and gather.traffic_bytes == gather.bytes * 3 // 4
    assert (reduce.shape, reduce.bytes, reduce.group_size) == ("f32[4]", 16, 2)  # iota groups [2,2]<=[4]
    assert reduce.traffic_bytes == 2 * 16 * 1 // 2
    assert (permute.shape, permute.bytes, permute.group_size, permute.traffic_bytes) == ("f32[4]", 16, 2, 16)
    assert all(c.executions == 1 and c.trip_count_known and c.computation == "main" for c in found)
    assert hlo.summarize(found)["all-gather"] == {"count": 1, "bytes": gather.bytes,
                                                 "traffic_bytes": gather.traffic_bytes}


def test_a_start_without_its_done_reads_the_output_from_its_tuple():
    entry = ASYNC_ENTRY.replace("all-gather-done(", "copy(").replace("collective-permute-done(", "copy(")
    gather, _, permute = hlo.collectives(module(ADD, entry))
    assert gather.shape == "(bf16[32,128], f32[16])" and permute.shape == "f32[4]"


def test_replica_group_forms():
    def group(groups: str, partitions: int = 8) -> int:
        entry = f"""ENTRY %main (p: f32[8]) -> f32[8] {{
  %p = f32[8]{{0}} parameter(0)
  ROOT %ar = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, to_apply=%add
}}"""
        (c,) = hlo.collectives(module(ADD, entry, partitions=partitions))
        return c.group_size

    assert group("{{0,1},{2,3},{4,5},{6,7}}") == 2
    assert group("{}") == 8  # all devices of the module
    assert group("[2,4]<=[8]") == 4
    assert group("[4,2]<=[2,4]T(1,0)") == 2
    assert group("mesh['axis_0'=4,'axis_1'=2] {'axis_0'}") == 4
    assert group("mesh['axis_0'=4,'axis_1'=2] {'axis_0','axis_1'}") == 8
    assert group("mesh['axis_0'=4,'axis_1'=2] {'axis_0':(1)2}") == 2  # a sub-axis
    with pytest.raises(ValueError, match="axis_9"):
        group("mesh['axis_0'=4] {'axis_9'}")


def test_async_collective_fusion_pieces_sharing_a_channel_are_one_op():
    # TPU splits one all-gather over start / continuation / done fusions, each holding a copy with one channel.
    pieces = [f"""%piece{i} (a{i}: f32[2,8]) -> f32[8,8] {{
  %a{i} = f32[2,8]{{1,0}} parameter(0)
  ROOT %ag{i} = f32[8,8]{{1,0}} all-gather(%a{i}), channel_id=7, replica_groups={{{{0,1,2,3}}}}, dimensions={{0}}
}}""" for i in range(3)]
    entry = """ENTRY %main (p: f32[2,8]) -> f32[8,8] {
  %p = f32[2,8]{1,0} parameter(0)
  %start = f32[8,8]{1,0} fusion(%p), kind=kCustom, calls=%piece0
  %mid = f32[8,8]{1,0} fusion(%p), kind=kCustom, calls=%piece1
  ROOT %done = f32[8,8]{1,0} fusion(%p), kind=kCustom, calls=%piece2
}"""
    (c,) = hlo.collectives(module(*pieces, entry))
    assert (c.kind, c.bytes, c.computation) == ("all-gather", 8 * 8 * 4, "main")  # the owner, not the fusion


def loop_module(cond_root: str, init: int, step: str, known: str = "", inner: str = "") -> str:
    """A `while` whose condition root is `cond_root` over `%i` (tuple element 0) and `%n` (element 1, constant
    16); the body steps `%i` by `step` and all-reduces."""
    return module(ADD, f"""%cond (c: (s32[], s32[], f32[8])) -> pred[] {{
  %c = (s32[], s32[], f32[8]{{0}}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] get-tuple-element(%c), index=1
  %k = s32[] constant(16)
  ROOT %lt = pred[] {cond_root}
}}""", f"""%body (b: (s32[], s32[], f32[8])) -> (s32[], s32[], f32[8]) {{
  %b = (s32[], s32[], f32[8]{{0}}) parameter(0)
  %bi = s32[] get-tuple-element(%b), index=0
  %bn = s32[] get-tuple-element(%b), index=1
  %bx = f32[8]{{0}} get-tuple-element(%b), index=2
  %step = s32[] constant({step})
  %next = s32[] add(%bi, %step)
  %ar = f32[8]{{0}} all-reduce(%bx), channel_id=1, replica_groups={{{{0,1,2,3}}}}, to_apply=%add
  ROOT %out = (s32[], s32[], f32[8]{{0}}) tuple(%next, %bn, %ar)
}}""", f"""ENTRY %main (x: f32[8]) -> f32[8] {{
  %x = f32[8]{{0}} parameter(0)
  %zero = s32[] constant({init})
  %start = s32[] copy(%zero)
  %bound = s32[] constant(16)
  %init = (s32[], s32[], f32[8]{{0}}) tuple(%start, %bound, %x)
  %w = (s32[], s32[], f32[8]{{0}}) while(%init), condition=%cond, body=%body{known}
  ROOT %r = f32[8]{{0}} get-tuple-element(%w), index=2
}}""")


@pytest.mark.parametrize("cond_root, init, step, trips", [
    ("compare(%i, %k), direction=LT", 0, "1", 16),
    ("compare(%i, %n), direction=LT", 0, "1", 16),  # the bound is a loop-invariant tuple element
    ("compare(%i, %k), direction=LT", 1, "2", 8),  # 1, 3, ..., 15
    ("compare(%i, %k), direction=LE", 0, "4", 5),  # 0, 4, 8, 12, 16
    ("compare(%k, %i), direction=GT", 10, "1", 6),  # the variable on the right
    ("compare(%i, %k), direction=NE", 4, "2", 6),
    ("compare(%i, %k), direction=GT", 20, "-1", 4),  # counting down
])
def test_static_trip_counts_are_read_from_the_loop(cond_root, init, step, trips):
    (c,) = hlo.collectives(loop_module(cond_root, init, step))
    assert (c.executions, c.trip_count_known, c.computation) == (trips, True, "body")
    assert hlo.summarize([c])["all-reduce"]["count"] == trips


def test_recorded_trip_count_wins_and_unknown_loops_are_flagged():
    known = ', backend_config={"known_trip_count":{"n":"3"}}'
    (c,) = hlo.collectives(loop_module("compare(%i, %k), direction=LT", 0, "1", known=known))
    assert (c.executions, c.trip_count_known) == (3, True)
    # A bound that is data (the tuple element is not constant at entry) has no static count.
    dynamic = loop_module("compare(%i, %n), direction=LT", 0, "1").replace("%bound = s32[] constant(16)",
                                                                             "%bound = s32[] parameter(1)")
    (c,) = hlo.collectives(dynamic)
    assert (c.executions, c.trip_count_known) == (1, False)
    (c,) = hlo.collectives(dynamic, default_trip_count=40)
    assert (c.executions, c.trip_count_known) == (40, False)


def test_nested_loops_multiply():
    inner = """%icond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %k = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%ibody (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %bi = s32[] get-tuple-element(%b), index=0
  %bx = f32[8]{0} get-tuple-element(%b), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%one, %bi)
  %ag = f32[8]{0} all-to-all(%bx), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  ROOT %out = (s32[], f32[8]{0}) tuple(%next, %ag)
}"""
    text = loop_module("compare(%i, %k), direction=LT", 0, "1").replace(
        "%ar = f32[8]{0} all-reduce(%bx), channel_id=1, replica_groups={{0,1,2,3}}, to_apply=%add",
        "%z = s32[] constant(0)\n  %it = (s32[], f32[8]{0}) tuple(%z, %bx)\n"
        "  %iw = (s32[], f32[8]{0}) while(%it), condition=%icond, body=%ibody\n"
        "  %ar = f32[8]{0} get-tuple-element(%iw), index=1")
    (c,) = hlo.collectives(text.replace("%cond (c:", inner + "\n\n%cond (c:"))
    assert (c.kind, c.executions, c.computation, c.traffic_bytes) == ("all-to-all", 16 * 5, "ibody", 32 * 3 // 4)


def test_dtype_and_shape_bytes():
    assert {t: hlo.dtype_bytes(t) for t in ("pred", "s8", "u8", "bf16", "f16", "f32", "s32", "u32", "f64", "s64",
                                            "u64", "c64", "c128", "f8e4m3fn", "f8e5m2", "s4", "u4", "token",
                                            "opaque")} == {
        "pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8,
        "u64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5, "token": 0,
        "opaque": 0}
    assert hlo.shape_bytes("bf16[3584,2368]{1,0:T(8,128)(2,1)}") == 3584 * 2368 * 2
    assert hlo.shape_bytes("(f32[8]{0}, /*index=1*/bf16[2,4], s4[3], token[], f32[])") == 32 + 16 + 2 + 0 + 4
    assert hlo.shape_bytes("f32[<=16,2]") == 16 * 2 * 4
    with pytest.raises(ValueError, match="q16"):
        hlo.dtype_bytes("q16")


def test_ring_traffic():
    assert hlo.ring_traffic("all-gather", 1024, 4) == 768
    assert hlo.ring_traffic("reduce-scatter", 256, 4) == 768  # input 1024 bytes
    assert hlo.ring_traffic("all-reduce", 1024, 4) == 1536
    assert hlo.ring_traffic("all-to-all", 1024, 4) == 768
    assert hlo.ring_traffic("collective-permute", 1024, 2) == 1024
    assert hlo.ring_traffic("all-reduce", 1024, 1) == 0


def test_kernel_names_and_splash_phases():
    assert hlo.splash_phase("splash_mha_fwd_no_residuals") == "forward"
    assert hlo.splash_phase("splash_mqa_fwd_segmented_residuals") == "forward"
    assert hlo.splash_phase("splash_mqa_dq_segmented_no_residuals") == "backward"
    assert hlo.splash_phase("splash_mha_dkv_no_residuals") == "backward"
    assert hlo.splash_phase("paged_attention_kernel") is None
    entry = """ENTRY %main (p: f32[8,128]) -> f32[8,128] {
  %p = f32[8,128]{1,0} parameter(0)
  %my_kernel.3.clone = f32[8,128]{1,0} custom-call(%p), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{}"
}}, backend_config={"custom_call_config":{"body":"TUzv"}}
  %custom-call.1 = f32[8,128]{1,0} custom-call(%my_kernel.3.clone), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{}"
}}, metadata={op_name="jit(f)/renamed_kernel/pallas_call"}
  ROOT %other = f32[8,128]{1,0} custom-call(%custom-call.1), custom_call_target="Sharding"
}"""
    assert hlo.pallas_kernels(module(entry)) == {"my_kernel": 1, "renamed_kernel": 1}


def test_no_entry_is_an_error():
    with pytest.raises(ValueError, match="ENTRY"):
        hlo.collectives("HloModule m\n")


# ---------------------------------------------------------------------------------------------------------------
# Programs compiled for TPU topologies (ahead of time, on this CPU)
# ---------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v5e():
    """A 4-chip `fsdp` mesh over v5e:2x2."""
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2", chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1)
    return jax.sharding.Mesh(np.array(topo.devices).reshape(4), ("fsdp",))


@pytest.fixture(scope="module")
def v5p():
    """A `(data, fsdp, tensor)` = 2x2x2 mesh over v5p:2x2x2."""
    topo = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2", chip_config_name="default",
                                        chips_per_host_bounds=(2, 2, 1), num_slices=1)
    return jax.sharding.Mesh(np.array(topo.devices).reshape(2, 2, 2), ("data", "fsdp", "tensor"))


def compiled_text(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def spec(mesh, shape, dtype, *axes):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*axes)))


def test_fsdp_matmul_all_gathers_the_whole_weight(v5e):
    x = spec(v5e, (64, 256), jnp.bfloat16, "fsdp")
    w = spec(v5e, (256, 512), jnp.bfloat16, "fsdp")  # rows sharded 4 ways: each chip holds a quarter
    found = hlo.collectives(compiled_text(lambda x, w: x @ w, x, w))
    gathers = [c for c in found if c.kind == "all-gather"]
    assert len(gathers) == 1
    assert gathers[0].bytes == 256 * 512 * 2 and gathers[0].group_size == 4
    assert gathers[0].traffic_bytes == 256 * 512 * 2 * 3 // 4
    assert hlo.summarize(found)["all-gather"]["bytes"] == 256 * 512 * 2


def test_sum_over_a_sharded_axis_reduces_across_the_chips(v5e):
    x = spec(v5e, (64, 256), jnp.float32, "fsdp")
    found = hlo.collectives(compiled_text(lambda x: x.sum(0), x))
    reducing = [c for c in found if c.kind in ("all-reduce", "reduce-scatter")]
    assert reducing and all(c.group_size == 4 for c in reducing)
    assert sum(c.bytes * (4 if c.kind == "reduce-scatter" else 1) for c in reducing) == 256 * 4


def test_collectives_in_loops_count_their_iterations(v5e):
    x = spec(v5e, (64, 256), jnp.bfloat16, "fsdp")
    layers = spec(v5e, (6, 256, 256), jnp.bfloat16, None, "fsdp")  # stacked weights, gathered one layer a step

    def scan(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    def fori(x, ws):
        return jax.lax.fori_loop(0, 6, lambda i, h: jnp.tanh(h @ ws[i]), x)

    def while_static(x, ws):
        return jax.lax.while_loop(lambda c: c[0] < 6, lambda c: (c[0] + 1, jnp.tanh(c[1] @ ws[c[0]])), (0, x))[1]

    for fn in (scan, fori, while_static):
        (gather,) = [c for c in hlo.collectives(compiled_text(fn, x, layers)) if c.kind == "all-gather"]
        assert (gather.executions, gather.trip_count_known, gather.bytes) == (6, True, 256 * 256 * 2), fn.__name__
        assert gather.computation != "main"  # the loop body


def test_a_loop_bounded_by_data_is_flagged(v5e):
    x = spec(v5e, (64, 256), jnp.bfloat16, "fsdp")
    layers = spec(v5e, (6, 256, 256), jnp.bfloat16, None, "fsdp")
    n = spec(v5e, (), jnp.int32)

    def while_dynamic(x, ws, n):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.tanh(c[1] @ ws[c[0] % 6])),
                                  (0, x))[1]

    (gather,) = [c for c in hlo.collectives(compiled_text(while_dynamic, x, layers, n)) if c.kind == "all-gather"]
    assert (gather.executions, gather.trip_count_known) == (1, False)


def test_shard_map_collectives(v5e):
    x = spec(v5e, (64, 256), jnp.float32, "fsdp")
    g = spec(v5e, (256, 256), jnp.float32, "fsdp")  # XLA turns smaller reduce-scatters into all-reduces

    def body(x, g):  # per chip x [16, 256], g [64, 256]
        y = jax.lax.all_to_all(x, "fsdp", 1, 1, tiled=True)  # [64, 64]
        z = jax.lax.ppermute(y, "fsdp", [(i, (i + 1) % 4) for i in range(4)])
        return z, jax.lax.psum_scatter(g, "fsdp", scatter_dimension=0, tiled=True)  # [16, 256]

    fn = jax.shard_map(body, mesh=v5e, in_specs=(P("fsdp"), P("fsdp")), out_specs=(P("fsdp"), P("fsdp")))
    found = {c.kind: c for c in hlo.collectives(compiled_text(fn, x, g))}
    assert sorted(found) == ["all-to-all", "collective-permute", "reduce-scatter"]
    assert found["all-to-all"].bytes == 16 * 256 * 4 and found["all-to-all"].group_size == 4
    assert found["collective-permute"].bytes == 64 * 64 * 4
    assert found["collective-permute"].traffic_bytes == 64 * 64 * 4
    assert found["reduce-scatter"].bytes == 16 * 256 * 4
    assert found["reduce-scatter"].traffic_bytes == 16 * 256 * 4 * 3


def test_splash_attention_kernels_forward_and_backward(v5p):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    B, H, T, D = 2, 2, 256, 128
    kernel = splash.make_splash_mha(masks.MultiHeadMask([masks.CausalMask((T, T))] * H), head_shards=1,
                                    q_seq_shards=1)
    qkv = spec(v5p, (B, H, T, D), jnp.bfloat16, "data")
    attend = jax.shard_map(jax.vmap(kernel), mesh=v5p, in_specs=(P("data"),) * 3, out_specs=P("data"),
                           check_vma=False)

    def layers(q, k, v):  # two calls in a scan: each kernel runs twice per program call
        return jax.lax.scan(lambda h, _: (attend(h, k, v), None), q, None, length=2)[0]

    forward = hlo.pallas_kernels(compiled_text(layers, qkv, qkv, qkv))
    assert {hlo.splash_phase(name) for name in forward} == {"forward"}
    assert sum(forward.values()) == 2

    loss = lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum()
    both = hlo.pallas_kernels(compiled_text(jax.grad(loss, argnums=(0, 1, 2)), qkv, qkv, qkv))
    phases = {name: hlo.splash_phase(name) for name in both}
    assert set(phases.values()) == {"forward", "backward"}, phases
    assert sum(n for name, n in both.items() if phases[name] == "backward") == 2  # dq and dkv
