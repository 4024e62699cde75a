"""``bench.saved_stablehlo``: the step's module cut from torch_xla's saved StableHLO, and the buffer donors of its
compile put back on its arguments."""
import pytest

from deepspeed_xla.bench import saved_stablehlo

STEP = """module @IrToHlo.34 attributes {mhlo.input_output_alias = []} {
  func.func @main(%arg0: tensor<64x32xf32>, %arg1: tensor<8x64xf32>, %arg2: tensor<f32>, %arg3: tensor<64x32xf32>) -> (tensor<f32>, tensor<64x32xf32>) {
    %0 = stablehlo.dot_general %arg1, %arg0, contracting_dims = [1] x [0] : (tensor<8x64xf32>, tensor<64x32xf32>) -> tensor<8x32xf32>
    return %arg2, %arg3 : tensor<f32>, tensor<64x32xf32>
  }
}"""
#: the header of the same graph's compiled HLO (an XLA dump's before_optimizations), as torch_xla 2.9 writes it
COMPILED = ("HloModule SyncTensorsGraph.34, buffer_donor={ (0, {}), (3, {}) }, entry_computation_layout={(f32[64,32]"
            "{1,0}, f32[8,64]{1,0}, f32[], f32[64,32]{1,0})->(f32[], f32[64,32]{1,0})}\n\nENTRY %main {}\n")


def _saved(*modules: str) -> str:
    return "".join(f"[ScheduleSyncTensorsGraph]\nTensorsGraphInfo:\n  step (train.py:1)\n\n## BEGIN_GRAPH\n{module}\n\n"
                   f"Graph Hash: 7453dabd\n\n## END_GRAPH\n\n" for module in modules)


def test_the_step_is_the_last_of_the_most_dots_without_its_hash():
    without_dots = STEP.replace("stablehlo.dot_general", "stablehlo.add").replace("@IrToHlo.34", "@read")
    step = saved_stablehlo.step_stablehlo(_saved(without_dots, STEP, STEP.replace("IrToHlo.34", "again"), without_dots))
    assert step.startswith("module @again") and step.rstrip().endswith("}") and "Graph Hash" not in step
    with pytest.raises(ValueError, match="XLA_SAVE_TENSORS_FMT=stablehlo"):
        saved_stablehlo.step_stablehlo("")


def test_donors_from_buffer_donor_and_from_a_users_aliases():
    assert saved_stablehlo.donors(COMPILED) == {0, 3}
    aliased = "HloModule m, input_output_alias={ {0}: (2, {}, may-alias), {1}: (5, {}, may-alias) }, entry_computation"
    assert saved_stablehlo.donors(aliased) == {2, 5}
    assert saved_stablehlo.donors("HloModule m, entry_computation_layout={(f32[])->f32[]}") == set()


def test_donors_are_marked_on_the_same_arguments():
    marked = saved_stablehlo.mark_donors(STEP, COMPILED)
    assert marked.count("{jax.buffer_donor = true}") == 2
    assert "%arg0: tensor<64x32xf32> {jax.buffer_donor = true}, %arg1: tensor<8x64xf32>, %arg2: tensor<f32>, " \
           "%arg3: tensor<64x32xf32> {jax.buffer_donor = true})" in marked
    assert marked.replace(" {jax.buffer_donor = true}", "") == STEP  # nothing else changed


def test_a_different_graph_is_refused():
    other = COMPILED.replace("f32[], f32[64,32]{1,0})->", "f32[])->")
    with pytest.raises(ValueError, match="3 parameters and the saved StableHLO 4 arguments: they are not the same"):
        saved_stablehlo.mark_donors(STEP, other)


def test_boolean_constants_are_written_a_byte_per_element():
    """torch_xla's MLIR packs a boolean constant's hex 8 elements a byte, lowest bit first; JAX's reads bytes."""
    packed = '%c = stablehlo.constant dense<"0x0501"> : tensor<2x5xi1>\n'  # 1010000010 as bits 0..9
    assert saved_stablehlo.bytewise_booleans(packed) == \
        '%c = stablehlo.constant dense<"0x01000100000000000100"> : tensor<2x5xi1>\n'
    assert saved_stablehlo.bytewise_booleans(saved_stablehlo.bytewise_booleans(packed)) == \
        saved_stablehlo.bytewise_booleans(packed)  # bytes already: left as they are
