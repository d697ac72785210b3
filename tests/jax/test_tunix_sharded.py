"""`logitless.tunix` on a mesh: a tiny Tunix Qwen2 (tied and untied head) laid out by Tunix's own sharding config over
fsdp x tp = 2 x 2 host CPU devices (the vocabulary over tp), scored and trained (Tunix's GRPO loss) under ``with
mesh:`` as Tunix's `RLCluster` and trainers run them: equal to stock Tunix on the same mesh, the weight's vocabulary
axis never gathered, no (B, T, V) logits, and the weight's gradient sharded as the weight. And one step of Tunix's
own GRPOLearner with every `RLCluster` role on that mesh, equal to stock's.

The device count must be set before jax is imported, so the runs happen in a fresh process
(tests/helpers/tunix_sharded.py)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test reads one fresh process's report

V, H = 4096, 32  # tests/helpers/tunix_sharded.py's vocabulary and hidden size
HEADS = ["lm_head", "tied"]
PROGRAMS = ["scoring", "grpo_step"]  # compute_per_token_logps with its entropy; value_and_grad of the GRPO loss


@pytest.fixture(scope="module")
def report() -> dict:
    if importlib.util.find_spec("tunix") is None:
        pytest.fail("Tunix is not installed: pip install 'logitless[tunix]'", pytrace=False)
    script = Path(__file__).parents[1] / "helpers" / "tunix_sharded.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"tunix_sharded.py: {result['seconds']:.0f} s, the learner step {result['grpo_learner']['seconds']:.0f} s")
    return result


def test_the_model_lies_on_tunixs_mesh_with_the_vocabulary_over_tp(report):
    assert report["devices"] == 4 and report["mesh"] == {"fsdp": 2, "tp": 2}
    assert report["heads"]["lm_head"]["weight_spec"] == "P('fsdp', 'tp')"  # lm_head's w (H, V): emb_dv
    assert report["heads"]["tied"]["weight_spec"] == "P('tp', 'fsdp')"  # the embedding (V, H): emb_vd


@pytest.mark.parametrize("head", HEADS)
def test_switched_scoring_and_grpo_loss_on_a_mesh_equal_stock_tunix(report, head):
    """Log-probs, entropy and loss within 16 fp32 roundings of stock's largest value, every gradient within 64 (as
    tests/jax/test_tunix.py allows on one device)."""
    result = report["heads"][head]
    assert result["log_probs"] <= 16 and result["entropy"] <= 16 and result["loss"] <= 16
    assert len(result["grads"]) >= 14 and not result["zero_grads"]  # every parameter took a real gradient
    assert all(roundings <= 64 for roundings in result["grads"].values()), result["grads"]


@pytest.mark.parametrize("head", HEADS)
def test_the_weights_vocabulary_is_never_gathered_and_its_gradient_keeps_the_sharding(report, head):
    result = report["heads"][head]
    assert result["weight_grad_spec"] == result["weight_spec"] == result["stock_weight_grad_spec"]
    for program in PROGRAMS:
        stock, switched = result["programs"][program]["stock"], result["programs"][program]["switched"]
        assert stock["logits"] and not switched["logits"], program  # (B, P + C, V), (B, C, V): stock's only
        assert switched["whole_weight_arrays"] == 0, program  # no device holds V x H
        # what is gathered: the hidden states (B C, H) and the device's vocabulary half over its hidden axis, which
        # Tunix shards over fsdp (FSDP's gather), never the vocabulary
        weight_shard = f"f32[{V // 2},{H}]"
        assert weight_shard in switched["gathered"], program
        assert all(str(V) not in shape for shape in switched["gathered"]), (program, switched["gathered"])
        assert switched["temp_bytes"] < stock["temp_bytes"], program


def test_one_grpo_learner_step_on_the_mesh_equals_stock_tunix(report):
    """Tunix's own GRPOLearner (vanilla rollout, a reference model, beta 0.04, 2 prompts x 2 generations, V = 4096)
    with every `RLCluster` role on the mesh, which lays the policy and the reference out by their ``shd_config`` (the
    vocabulary over tp), one step: with the switch, every logged metric within 16 fp32 roundings of stock's, every
    gradient and updated parameter within 64 (a zero-initialized bias, after the step, is its update alone); the fused
    op traced for the reference's scoring and the policy's loss, and the head's weight and its gradient still split
    over tp after the step."""
    step = report["grpo_learner"]
    assert step["weight_spec"] == step["weight_grad_spec"] == "P('fsdp', 'tp')"
    assert step["moved"] == [True, True]  # both steps changed the policy
    assert step["fused_calls"][0] == 0 and step["fused_calls"][1] >= 2
    assert set(step["logged"]) == set(step["stock_logged"])
    assert {f"actor/train/{name}" for name in ("loss", "kl", "pg_clipfrac", "grad_norm")} <= set(step["logged"])
    assert all(roundings <= 16 for roundings in step["logged"].values()), step["logged"]
    assert len(step["grads"]) >= 14 and all(roundings <= 64 for roundings in step["grads"].values()), step["grads"]
    assert step["params"].keys() == step["grads"].keys()
    assert all(roundings <= 64 for roundings in step["params"].values()), step["params"]
