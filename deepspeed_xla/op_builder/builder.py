"""Base for builders whose ``load()`` returns a Python object instead of a compiled extension."""
from deepspeed.ops.op_builder.builder import OpBuilder


class PythonOpBuilder(OpBuilder):
    """An op implemented in torch: always compatible, nothing to compile, nothing to cache."""

    #: Set by subclasses: the object ``load()`` returns (DeepSpeed calls its methods as the op).
    implementation = None

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return f"deepspeed_xla.op_builder.{self.NAME}_op"

    def sources(self):
        return []

    def include_paths(self):
        return []

    def is_compatible(self, verbose=False):
        return True

    def load(self, verbose=True):
        return self.implementation
