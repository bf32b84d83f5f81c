"""Communication cost model used to decide between moving tokens and moving experts."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommCostModel:
    """Bytes on the wire per iteration for the two ways of bringing a token-expert pair together.

    Moving n tokens to the expert costs 4 transfers of n*hidden activations (dispatch and combine, forward and
    backward). Materializing the expert costs one SparseAllGather of its parameters plus one SparseReduceScatter
    of its gradient, independent of n.
    """

    hidden_size: int
    expert_numel: int
    activation_bytes: int = 4
    param_bytes: int = 4
    grad_bytes: int = 4

    def token_bytes(self, num_tokens: int) -> int:
        return 4 * num_tokens * self.hidden_size * self.activation_bytes

    @property
    def expert_bytes(self) -> int:
        """Bytes of one SparseAllGather + SparseReduceScatter of one expert."""
        return self.expert_numel * (self.param_bytes + self.grad_bytes)

    def materialize_is_cheaper(self, num_tokens: int) -> bool:
        """True when gathering the expert moves fewer bytes than sending its tokens away and back."""
        return self.token_bytes(num_tokens) > self.expert_bytes
