"""What admission filters and eviction policies share as configured objects:
a policy is its constructor's arguments (`get_config`, a JSON-serialisable
dict, Keras's serialization), so it is rebuilt from them and two policies of
one class with equal configs are equal."""

__all__ = ["ConfiguredPolicy"]


class ConfiguredPolicy:
    """Mixin: `from_config`, `__eq__` and `__hash__` from `get_config()`."""

    @classmethod
    def from_config(cls, config):
        """The policy `get_config` describes."""
        return cls(**config)

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self), tuple(sorted(self.get_config().items()))))
