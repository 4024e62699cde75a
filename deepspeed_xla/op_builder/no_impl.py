"""The builder for every DeepSpeed op that has no XLA implementation."""
from deepspeed.ops.op_builder.builder import OpBuilder


class NotImplementedBuilder(OpBuilder):
    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"
    NAME = "deepspeed_not_implemented"

    def __init__(self, name=None):
        super().__init__(name=self.NAME if name is None else name)

    def absolute_name(self):
        return f"deepspeed_xla.op_builder.{self.NAME}_op"

    def sources(self):
        return []

    def is_compatible(self, verbose=False):
        return False

    def load(self, verbose=True):
        raise ValueError(f"DeepSpeed op '{self.name}' has no XLA implementation in deepspeed_xla; use the "
                         "pure-PyTorch path instead (e.g. \"torch_adam\": true, or a torch.optim optimizer).")
