"""torch's ``nn.Linear`` refuses an input whose float dtype is not its weight's on XLA, as on CPU and CUDA.

There, ``mat1 and mat2 must have the same dtype`` is raised at the layer, in the user's forward. torch_xla traces the
layer instead: with a bias, XLA's compiler refuses the step's graph at ``engine.step()`` (*Seen floating point types
of different precisions … mixed precision is disallowed*, naming HLO instructions); without one, the layer runs in
float32 on a bfloat16 model. Under autocast the dtypes may differ: autocast casts both.
"""
import functools

MIXED = ("deepspeed_xla: {layer} got a {input} input, but its weight is {weight}: torch refuses this on CPU and CUDA "
         "(mat1 and mat2 must have the same dtype); on XLA the step's graph would fail to compile at engine.step() "
         "(with a bias) or the layer would compute in float32 (without). Cast the "
         "batch to the model's dtype before the forward (batch.to(torch.{weight})): DeepSpeed's \"bf16\" section "
         "does not cast inputs (\"auto_cast\" is in its \"fp16\" section only). Or keep the model in float32 and "
         "compute in bfloat16 with \"torch_autocast\": {{\"enabled\": true, \"dtype\": \"bfloat16\"}}.")


def _autocast(device_type: str) -> bool:
    import torch  # here, on the rare mismatch only: this module imports no torch, and every forward passes above
    return torch.is_autocast_enabled(device_type)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def linear_refuses_mixed_dtypes(original):
    """``nn.Linear.forward``: the dtype check CPU's and CUDA's matmul kernels make, on the host while tracing (no
    device read, nothing added to the graph). Applied when DeepSpeed's engine module loads (torch loads before the
    startup hook sees it)."""

    @functools.wraps(original)
    def forward(self, input):
        weight = self.weight
        if (input.dtype != weight.dtype and input.is_floating_point() and weight.is_floating_point()
                and input.device.type == "xla" and not _autocast("xla")):
            raise RuntimeError(MIXED.format(layer=f"{type(self).__name__}({self.in_features} -> {self.out_features})",
                                            input=_name(input.dtype), weight=_name(weight.dtype)))
        return original(self, input)

    return forward
