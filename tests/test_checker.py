"""The losslessness checker (ddtree/engine/checker.py): tie flips against errors, and checking after a tie flip."""
import pytest
import torch

from ddtree.engine.checker import check_tokens


def test_checker_classifies_tie_flips_and_errors():
    ref = [5, 6, 7, 8]
    near_tie = torch.tensor([0.0, 10.0, 10.0 - 1e-6, 3.0])
    clear = torch.tensor([0.0, 10.0, 7.0, 3.0])
    assert check_tokens(ref, ref, lambda i: clear, torch.float32).kind == "identical"
    v = check_tokens(ref, [5, 6, 2, 2], lambda i: near_tie, torch.float32)
    assert v.kind == "tie_flip" and v.position == 2 and v.ok
    v = check_tokens(ref, [5, 6, 2, 2], lambda i: clear, torch.float32)
    assert v.kind == "error" and not v.ok and "margin 3" in v.describe()
    # bf16 noise is far larger: a 0.05 margin on logits near 10 is a tie there, an error in fp32
    small = torch.tensor([0.0, 10.0, 9.95])
    assert check_tokens(ref, [5, 1], lambda i: small, torch.bfloat16).kind == "tie_flip"
    assert check_tokens(ref, [5, 1], lambda i: small, torch.float32).kind == "error"
    # same prefix, different length: an error (a stop decision diverged)
    assert check_tokens(ref, ref[:3], lambda i: clear, torch.float32).kind == "error"


def test_checker_keeps_checking_after_a_tie_flip():
    """After a tie flip, each later token must be the target's own choice given the method's own prefix: a
    continuation that follows the target passes, one wrong token after the flip is an error at its place."""
    ref = [5, 6, 7, 8]
    near_tie = torch.tensor([0.0, 10.0, 10.0 - 1e-6, 3.0])  # token 1 and 2 tie at the divergence (position 2)
    method = [5, 6, 2, 3, 1]  # flips to 2 at position 2, then goes its own way

    def own(choices):  # the target's logits for each of the method's tokens given its own prefix
        rows = torch.zeros(len(method), 10)
        rows[torch.arange(len(method)), torch.tensor(choices)] = 9.0
        return lambda: rows

    v = check_tokens(ref, method, lambda i: near_tie, torch.float32, own([5, 6, 2, 3, 1]))
    assert v.kind == "tie_flip" and v.position == 2
    v = check_tokens(ref, method, lambda i: near_tie, torch.float32, own([5, 6, 2, 3, 4]))
    assert v.kind == "error" and v.position == 4 and v.reference_token == 4 and v.method_token == 1
    assert v.margin == pytest.approx(9.0)
    # without the method's own logits only the first divergence can be judged
    assert check_tokens(ref, method, lambda i: near_tie, torch.float32).kind == "tie_flip"
