"""--padding_free: scoring and the update on rows packed without pad tokens (model/packing.py pack_rows) give the
padded path's log-probs, values, losses and gradients to float rounding; a row's log-probs do not depend on the
rows packed beside it (transformers' packed-sequence masks keep attention within each row)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import trainer.estimators  # registers the estimators
import trainer.losses  # noqa: F401 - registers the losses
from model.config import MiniMindConfig
from model.critic import CriticModel
from model.forward import attention_break_even, critic_forward, policy_forward, shares_prompts
from model.modeling import MiniMindForCausalLM
from model.packing import pack_rows
from tests.helpers import ROOT, build_update_world, run_experience, run_update
from trainer.registry import estimator_names, policy_loss_names

FIXTURES = ROOT / "tests" / "fixtures"
# fp32 on a CPU: the packed forward runs other matmul shapes, so sums may round differently.
ATOL = 2e-5


def _assert_grads_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    """Each gradient within `rel` of its largest entry (fp32 rounding of sums of large terms), give or take 1e-8 of
    the model's largest gradient (below fp32's resolution of it): an MoE router's gradient with one expert per
    token is 0 but for rounding (its softmax weight is renormalised to 1)."""
    assert got.keys() == want.keys() and len(want) > 10
    top = max(w.abs().max().item() for w in want.values())
    for k in want:
        err, scale = (got[k] - want[k]).abs().max().item(), want[k].abs().max().item()
        assert err <= rel * scale + 1e-8 * top, f"{k}: max |diff| {err:.3g} against max |value| {scale:.3g}"


def _native(arch: str = "qwen3", use_moe: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return MiniMindForCausalLM(MiniMindConfig(hidden_size=64, num_hidden_layers=2, arch=arch, use_moe=use_moe)).eval()


def _hf(family: str, tmp: Path) -> torch.nn.Module:
    from tests.tiny_hf import save_tiny_causal_lm

    return save_tiny_causal_lm(tmp / family, family=family, hidden=32, layers=2)[0]


MODELS = ["minimind_qwen3", "minimind_llama", "minimind_moe", "hf_llama", "hf_qwen2"]


def _fast_only(values: list, fast: set) -> list:
    """pytest params: those in `fast` in the fast tier, the rest marked slow."""
    return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


def _model(name: str, tmp: Path, attn: str) -> torch.nn.Module:
    m = {"minimind_qwen3": lambda: _native(), "minimind_llama": lambda: _native("llama"),
         "minimind_moe": lambda: _native(use_moe=True), "hf_llama": lambda: _hf("llama", tmp),
         "hf_qwen2": lambda: _hf("qwen2", tmp)}[name]()
    m.set_attn_implementation(attn)
    return m


def _batch(vocab: int, prompt_lens: list[int], response_lens: list[int], P: int, R: int, seed: int = 1):
    """sequences [B, P+R]: each row's prompt left-padded to P, its response right-padded to R (pad id 0)."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    seq = torch.randint(3, vocab, (B, P + R), generator=g)
    att = torch.zeros(B, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        att[b, P - p:P + r] = 1
    return seq * att, att


LAYOUTS = {  # (prompt lengths, response lengths, P, R)
    "left_padded": ([10, 2, 5, 3, 8], [3, 3, 3, 3, 3], 10, 3),
    "right_padded": ([7, 7, 7, 7, 7], [6, 2, 0, 4, 1], 7, 6),
    "both": ([7, 3, 5, 1, 6], [6, 2, 0, 4, 1], 7, 6),
}


def test_pack_rows_places_whole_rows_with_their_own_positions():
    seq, att = _batch(100, *LAYOUTS["both"])
    pk = pack_rows(seq, att, 6, break_even=1e9)  # attention costs nothing: the fewest token slots win
    lengths = att.sum(1).tolist()  # [13, 5, 5, 5, 7]
    assert pk is not None and pk.kept == 35  # the 35 real tokens in one row, against 5 x 13 padded
    flat_ids, flat_pos = pk.input_ids.flatten().tolist(), pk.position_ids.flatten().tolist()
    for b in range(5):  # each row's real tokens, in order, at positions 0..n-1, somewhere in the packed rows
        row = seq[b][att[b].bool()].tolist()
        starts = [i for i in range(len(flat_ids) - lengths[b] + 1)
                  if flat_ids[i:i + lengths[b]] == row and flat_pos[i:i + lengths[b]] == list(range(lengths[b]))]
        assert starts, b
    # Costly attention: rows no wider than the longest (13 | 7 + 5 | 5 + 5), never more work than padded.
    assert pack_rows(seq, att, 6, break_even=1.0).input_ids.shape == (3, 13)
    # Nothing to remove (no pads): the padded forward, unchanged.
    assert pack_rows(seq, torch.ones_like(att), 6) is None


def test_flash_attention_kernels_get_one_packed_row():
    """transformers' flash-attention path reads packed bounds from position_ids only in a batch of one row: under
    it, everything goes into one row (its varlen kernel attends within each sequence, so that costs nothing)."""
    m = _native()
    assert attention_break_even(m) == 480.0  # 64 wide, 8 + 4 heads of 8: (64 x 8 x (16 + 8) + 3 x 64 x 256) / 128
    m.config._attn_implementation = "flash_attention_2"  # only read here; the kernel is not run (no GPU)
    assert attention_break_even(m) == float("inf")
    seq, att = _batch(100, *LAYOUTS["both"])
    pk = pack_rows(seq, att, 6, attention_break_even(m))
    assert pk.input_ids.shape == (1, int(att.sum()))
    seq, att = _batch(100, [2, 2, 4], [2, 2, 4], P=4, R=4)  # 4 + 4 fill a row of 8 as well as 8 does
    assert pack_rows(seq, att, 4, attention_break_even(m)).input_ids.shape == (1, 16)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", _fast_only(MODELS, {"minimind_qwen3", "hf_llama"}))
def test_a_rows_log_probs_do_not_change_when_its_packed_neighbour_changes(name, attn, tmp_path):
    m = _model(name, tmp_path, attn)
    vocab = m.config.vocab_size
    seq, att = _batch(vocab, [5, 2, 3], [5, 2, 3], P=5, R=5)  # 10, 4, 6 real tokens: rows 1 and 2 fill one bin of 10
    pk = pack_rows(seq, att, 5, attention_break_even(m))  # the layout policy_forward takes
    assert pk is not None
    bins = [set((pk.before[_row_slice(pk, b)] // pk.input_ids.shape[1]).tolist()) for b in range(3)]
    assert bins[1] == bins[2] and len(bins[1]) == 1  # rows 1 and 2 share one packed row
    with torch.no_grad():
        lp, _ = policy_forward(m, seq, att, 5, padding_free=True)
        other = seq.clone()
        other[2] = torch.where(att[2].bool(), (seq[2] + 7) % (vocab - 3) + 3, seq[2])  # row 2: other tokens
        lp2, _ = policy_forward(m, other, att, 5, padding_free=True)
        resp = att[:, -5:].bool()
        assert not torch.allclose(lp[2][resp[2]], lp2[2][resp[2]])  # row 2 did change
        torch.testing.assert_close(lp[1], lp2[1], rtol=0, atol=1e-6)  # its bin neighbour did not
        # The check can fail: the same packed rows with positions running on (no restart: one sequence per bin)
        # let row 1's tokens see row 2's, and its log-probs move.
        assert _row1_with_running_positions(m, seq, att) != _row1_with_running_positions(m, other, att)


def _row_slice(pk, b: int) -> slice:
    """Row b's entries of pk.before (row-major over pk.at)."""
    counts = pk.at.sum(1).tolist()
    return slice(sum(counts[:b]), sum(counts[:b + 1]))


def _row1_with_running_positions(m, seq, att) -> list[float]:
    pk = pack_rows(seq, att, 5, attention_break_even(m))
    pos = torch.arange(pk.input_ids.shape[1]).expand_as(pk.input_ids)
    logits = m(input_ids=pk.input_ids, attention_mask=None, position_ids=pos, use_cache=False).logits
    return logits.flatten(0, 1)[pk.before[_row_slice(pk, 1)]].sum(-1).tolist()


def _losses_and_grads(m, critic, seq, att, R, padding_free: bool):
    m.zero_grad()
    critic.zero_grad()
    resp = att[:, -R:].float()
    g = torch.Generator().manual_seed(5)
    w = torch.randn(resp.shape, generator=g)
    lp, ent = policy_forward(m, seq, att, R, 0.7, with_entropy=True, padding_free=padding_free)
    v = critic_forward(critic, seq, att, R, padding_free=padding_free)
    ((lp * w * resp).sum() + (ent * resp).sum() + ((v - w) ** 2 * resp).sum()).backward()
    grads = {n: p.grad.clone() for n, p in [*m.named_parameters(), *critic.named_parameters()] if p.grad is not None}
    return lp.detach() * resp, ent.detach() * resp, v.detach() * resp, grads


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", _fast_only(MODELS, {"minimind_qwen3", "hf_qwen2"}))
def test_packed_log_probs_values_and_gradients_equal_the_padded(name, attn, layout, tmp_path):
    m = _model(name, tmp_path, attn)
    critic = CriticModel.from_policy(m)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # a zero head would hide the trunk's gradient
    seq, att = _batch(m.config.vocab_size, *LAYOUTS[layout])
    R = LAYOUTS[layout][3]
    assert pack_rows(seq, att, R, attention_break_even(m)) is not None
    padded = _losses_and_grads(m, critic, seq, att, R, padding_free=False)
    packed = _losses_and_grads(m, critic, seq, att, R, padding_free=True)
    for a, b in zip(padded[:3], packed[:3]):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL)
    _assert_grads_close(packed[3], padded[3])


def _grouped(vocab: int, groups: list[tuple[int, list[int]]], P: int, R: int, seed: int = 2):
    """GRPO's layout: each group's rows the same left-padded prompt of its length, their own responses."""
    prompt_lens = [p for p, rs in groups for _ in rs]
    seq, att = _batch(vocab, prompt_lens, [r for _, rs in groups for r in rs], P, R, seed)
    b = 0
    for _, rs in groups:
        seq[b:b + len(rs), :P] = seq[b, :P]
        b += len(rs)
    return seq, att


GROUPED = ([(9, [4, 1, 6]), (3, [6, 6, 2]), (7, [0, 5, 3])], 9, 6)  # a row with no response token among them


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", _fast_only(MODELS, {"minimind_qwen3", "hf_llama"}))
def test_rows_sharing_a_prompt_pack_it_once_and_equal_the_padded(name, attn, tmp_path):
    """GRPO's groups: each prompt's tokens run once for its rows (Packing.mask: each response attends to the prompt
    and to itself), with the padded path's log-probs, entropies, values and gradients to float rounding."""
    m = _model(name, tmp_path, attn)
    critic = CriticModel.from_policy(m)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    seq, att = _grouped(m.config.vocab_size, *GROUPED)
    R = GROUPED[2]
    shared = pack_rows(seq, att, R, 1e9, share_prompts=attn)
    assert shared is not None and shared.shared is not None
    assert shared.kept == 9 + 3 + 7 + int(att[:, -R:].sum())  # every prompt once, every response token
    assert shared.kept < pack_rows(seq, att, R, 1e9).kept
    assert shares_prompts(m) == attn
    assert pack_rows(seq, att, R, attention_break_even(m), share_prompts=attn).shared is not None  # what runs
    padded = _losses_and_grads(m, critic, seq, att, R, padding_free=False)
    packed = _losses_and_grads(m, critic, seq, att, R, padding_free=True)
    for a, b in zip(padded[:3], packed[:3]):
        torch.testing.assert_close(b, a, rtol=0, atol=ATOL)
    _assert_grads_close(packed[3], padded[3])


def test_a_shared_prompt_is_not_read_by_another_groups_rows_nor_a_response_by_its_siblings():
    m = _native()
    m.set_attn_implementation("sdpa")
    seq, att = _grouped(m.config.vocab_size, *GROUPED)
    R = GROUPED[2]
    with torch.no_grad():
        lp, _ = policy_forward(m, seq, att, R, padding_free=True)
        other = seq.clone()
        other[1, -R:] = torch.where(att[1, -R:].bool(), (seq[1, -R:] + 7) % (m.config.vocab_size - 3) + 3, seq[1, -R:])
        other[3:6, :9] = torch.where(att[3:6, :9].bool(), (seq[3:6, :9] + 5) % (m.config.vocab_size - 3) + 3, seq[3:6, :9])
        lp2, _ = policy_forward(m, other, att, R, padding_free=True)
    resp = att[:, -R:].bool()
    assert not torch.allclose(lp[1][resp[1]], lp2[1][resp[1]]) and not torch.allclose(lp[3][resp[3]], lp2[3][resp[3]])
    for b in (0, 2, 6, 7, 8):  # row 1's siblings and the third group: untouched by row 1's or group 2's change
        torch.testing.assert_close(lp[b], lp2[b], rtol=0, atol=1e-6)


def test_prompts_are_shared_only_where_the_attention_takes_a_mask():
    m = _native()
    for impl, want in (("sdpa", "sdpa"), ("eager", "eager"), ("flash_attention_2", None), ("flex_attention", None)):
        m.config._attn_implementation = impl  # only read here
        m.model.config._attn_implementation = impl
        assert shares_prompts(m) == want, impl
    m.config._attn_implementation = m.model.config._attn_implementation = "sdpa"
    m.model.config.layer_types = ["sliding_attention", "full_attention"]
    assert shares_prompts(m) is None


def test_packed_forward_under_bf16_autocast_is_within_bf16_rounding_of_the_padded():
    m = _native()
    m.set_attn_implementation("eager")  # the update's kernel under bf16 on a CPU
    seq, att = _batch(m.config.vocab_size, *LAYOUTS["both"])
    resp = att[:, -6:].bool()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        a, _ = policy_forward(m, seq, att, 6)
        b, _ = policy_forward(m, seq, att, 6, padding_free=True)
    assert (a - b)[resp].abs().max().item() < 0.05  # bf16's 8-bit mantissa; fp32 agrees to 2e-5 above
    seq, att = _grouped(m.config.vocab_size, *GROUPED)  # rows sharing prompts, under both kernels
    resp = att[:, -GROUPED[2]:].bool()
    for attn in ("eager", "sdpa"):
        m.set_attn_implementation(attn)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            a, _ = policy_forward(m, seq, att, GROUPED[2])
            b, _ = policy_forward(m, seq, att, GROUPED[2], padding_free=True)
        assert (a - b)[resp].abs().max().item() < 0.05, attn


# ------------------------------------------------------------------ the whole step, on vs off, same seed
def _twin(flags: list[str]) -> list[tuple]:
    """make_experience and one update from the same seed with --padding_free 0 and 1: the rollout, the update's
    stats, the first minibatch's gradients (actor and critic, before the optimizer step), the actor's weights
    before and after."""
    import trainer.update as U

    out = []
    for pf in ("0", "1"):
        w = build_update_world([*flags, "--padding_free", pf], n_prompts=2)
        start = {n: p.detach().clone() for n, p in w.actor.named_parameters()}
        grads: dict[str, torch.Tensor] = {}
        step = U.optimizer_step

        def first_grads(opt, trained, *a, **k):
            if not grads:
                grads.update({f"{m}.{n}": p.grad.clone() for m, model in trained.items()
                              for n, p in model.named_parameters() if p.grad is not None})
            return step(opt, trained, *a, **k)

        U.optimizer_step = first_grads
        try:
            ro, _ = run_experience(w)
            stats = run_update(w, ro)
        finally:
            U.optimizer_step = step
        out.append((ro, stats, grads, start, {n: p.detach().clone() for n, p in w.actor.named_parameters()}))
    return out


def _assert_twins_equal(twins: list[tuple], critic: bool = False) -> None:
    """Scores, advantages, losses and gradients equal to rounding. The weights after Adam's steps only nearly: its
    first step moves each weight by ~lr x sign(gradient), so a gradient that is 0 but for rounding moves its
    weight by +-lr either way."""
    (ro0, st0, g0, start, p0), (ro1, st1, g1, _, p1) = twins
    m = ro0.response_mask.bool()
    assert torch.equal(ro0.sequences, ro1.sequences) and torch.equal(ro0.response_mask, ro1.response_mask)
    assert (ro0.attention_mask == 0).any(), "no pads: the check would prove nothing"
    fields = ["old_logprobs", "ref_logprobs", "advantages", "returns"] + (["values"] if critic else [])
    for f in fields:
        torch.testing.assert_close(getattr(ro1, f)[m], getattr(ro0, f)[m], rtol=1e-4, atol=ATOL, msg=f)
    assert st0.keys() == st1.keys()
    for k in st0:
        if k.startswith(("loss/", "grad_norm/", "ppo/approx_kl", "ppo/ratio")):
            assert st1[k] == pytest.approx(st0[k], rel=1e-4, abs=1e-5), k
    _assert_grads_close(g1, g0)
    assert critic == any(k.startswith("critic.") for k in g0)
    moved = sum((p0[n] - start[n]).abs().sum().item() for n in p0)
    assert moved > 0, "the update moved nothing"
    assert sum((p1[n] - p0[n]).abs().sum().item() for n in p0) < 1e-3 * moved


def _group_flags(estimator: str, *more: str) -> list[str]:
    return ["--advantage_estimator", estimator, "--num_generations", "2", "--batch_size", "2", "--mini_batch_size", "2",
            "--reward_fn", f"{FIXTURES / 'toy_rewards.py'}:low_id_share", "--temperature", "1.0",
            "--learning_rate", "1e-3", "--device", "cpu", *more]


@pytest.mark.parametrize("estimator", _fast_only(estimator_names(), {"gae", "grpo"}))
def test_each_estimator_same_seed_same_step_with_padding_free_on_and_off(estimator):
    _assert_twins_equal(_twin(_group_flags(estimator)), critic=estimator == "gae")


@pytest.mark.parametrize("loss", _fast_only(policy_loss_names(), set()))  # vanilla: the grpo estimator's case
def test_each_policy_loss_same_seed_same_step_with_padding_free_on_and_off(loss):
    _assert_twins_equal(_twin(_group_flags("grpo", "--policy_loss", loss, "--entropy_coef", "0.01")))


@pytest.mark.slow  # two PPO steps (~10 s on 2 shared cores)
def test_gae_reusing_the_critics_scoring_graph_same_step_with_padding_free_on_and_off():
    flags = _group_flags("gae", "--reuse_values", "1", "--mini_batch_size", "4", "--ppo_update_iters", "1",
                         "--accumulation_steps", "1")
    _assert_twins_equal(_twin(flags), critic=True)


@pytest.mark.slow  # two PPO steps (~10 s on 2 shared cores)
def test_lora_same_step_with_padding_free_on_and_off():
    twins = _twin(_group_flags("grpo", "--lora_r", "4", "--lora_alpha", "8"))
    _assert_twins_equal(twins)
    (_, _, _, start, p0), _ = twins
    moved = {n for n in p0 if not torch.equal(p0[n], start[n])}
    assert moved and all("lora_" in n for n in moved)  # the adapters trained, the base did not


@pytest.mark.slow  # two PPO steps (~10 s on 2 shared cores)
def test_hf_actor_same_step_with_padding_free_on_and_off(tmp_path):
    from tests.tiny_hf import save_tiny_causal_lm

    save_tiny_causal_lm(tmp_path / "hf", family="qwen2", hidden=32, layers=2)
    _assert_twins_equal(_twin(_group_flags("gae", "--actor_path", str(tmp_path / "hf"))), critic=True)


def test_multi_turn_tool_episodes_score_and_train_the_same_packed(monkeypatch):
    """An episode with a masked tool turn between the policy's turns (trainer/multiturn.py) beside a one-turn row:
    the policy's tokens' log-probs, values and gradients equal the padded path's."""
    from tests import test_multiturn as TM
    from trainer import multiturn
    from trainer.tools import ToolRunner, load_tools

    runner = ToolRunner(load_tools(TM.TOOLS), timeout=2.0)
    try:
        from model.loader import load_tokenizer

        tok = load_tokenizer()
        batch = TM.batch_of(tok, ["37乘以8等于多少？", "What is 2 + 3?"], runner.toolbox.schema_list())
        turns = {TM.prompt_key(batch, 0): [TM.CALL, TM.ANSWER], TM.prompt_key(batch, 1): ["\n</think>\n5"]}
        monkeypatch.setattr(multiturn, "draw", TM.scripted(tok, turns))
        ro, _ = multiturn.generate_episodes(None, tok, runner, batch, max_turns=3, max_total_len=1024, max_new_tokens=64,
                                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    finally:
        runner.close()
    mask = ro.response_mask.bool()
    assert (~mask[0] & ro.attention_mask[0, ro.prompt_len:].bool()).any()  # the tool turn: read, not trained
    m = _native()
    critic = CriticModel.from_policy(m)
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)
    att = ro.attention_mask  # the episode's own: 1 on the tool turn's tokens (read), 0 on the pads
    runs = []
    for pf in (False, True):
        m.zero_grad()
        critic.zero_grad()
        lp, _ = policy_forward(m, ro.sequences, att, ro.response_len, padding_free=pf)
        v = critic_forward(critic, ro.sequences, att, ro.response_len, padding_free=pf)
        ((lp * mask).sum() + (v * mask).sum()).backward()
        runs.append((lp.detach()[mask], v.detach()[mask], {n: p.grad.clone() for n, p in m.named_parameters()}))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=ATOL)
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=ATOL)
    _assert_grads_close(runs[1][2], runs[0][2])


# ------------------------------------------------------------------ fsdp2: 2 gloo processes
def _fsdp2_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    import train_ppo as T
    from dataset.rlaif import RLAIFDataset, collate_left_pad, read_rlaif_jsonl
    from tests.helpers import UPDATE_BASE_FLAGS, phase_for
    from trainer.run import distributed
    from trainer.run.setup import setup
    from trainer.run.sharding import full_state_dict, is_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    info = distributed.init_distributed("cpu", timeout_s=120)
    try:
        res = {}
        for pf in ("0", "1"):
            built = setup(T.parse_args([*UPDATE_BASE_FLAGS, *_group_flags("gae"), "--strategy", "fsdp2",
                                        "--padding_free", pf]), info)
            assert is_sharded(built.models.actor) and is_sharded(built.models.critic)
            start = (full_state_dict(built.models.actor), full_state_dict(built.models.critic))
            records, _ = read_rlaif_jsonl(ROOT / "dataset" / "demo_train.jsonl")
            ds = RLAIFDataset(records[2 * rank:2 * rank + 2], built.models.tok, max_prompt_len=48, seed=0)
            batch = collate_left_pad([ds[i] for i in range(2)], pad_id=built.models.tok.pad_token_id)
            w = type("W", (), {"runtime": built.runtime})
            exp = T.make_experience(built.cfg, batch, built.models, built.runtime, built.kl_ctl.value, built.custom_fns,
                                    phase_for(w))
            stats = T.ppo_update(built.cfg, exp.rollout, built.models, built.optim, 0, built.runtime, built.kl_ctl.value,
                                 phase_for(w))
            ro = exp.rollout
            res[pf] = ({k: getattr(ro, k) for k in ("sequences", "attention_mask", "response_mask", "old_logprobs",
                                                    "ref_logprobs", "values", "advantages")},
                       stats, full_state_dict(built.models.actor), full_state_dict(built.models.critic), start)
        torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    finally:
        distributed.cleanup(info)


@pytest.mark.slow  # two gloo processes, two sharded runs each (~30 s on 2 shared cores)
def test_fsdp2_two_ranks_same_step_with_padding_free_on_and_off(tmp_path):
    from tests.helpers import spawn_ranks

    spawn_ranks(_fsdp2_worker, 2, tmp_path, 300, "2-process fsdp2 padding-free twins")
    for rank in (0, 1):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        (ro0, st0, a0, c0, start), (ro1, st1, a1, c1, _) = res["0"], res["1"]
        m = ro0["response_mask"].bool()
        assert torch.equal(ro0["sequences"], ro1["sequences"]) and (ro0["attention_mask"] == 0).any()
        for f in ("old_logprobs", "ref_logprobs", "values", "advantages"):
            torch.testing.assert_close(ro1[f][m], ro0[f][m], rtol=1e-4, atol=ATOL, msg=f)
        for k in st0:
            if k.startswith(("loss/", "grad_norm/")):
                assert st1[k] == pytest.approx(st0[k], rel=1e-4, abs=1e-5), k
        if rank == 0:  # the whole weights after Adam's step (rank 0 holds them): as near as _assert_twins_equal's
            assert a0 and c0
            for after0, after1, before in ((a0, a1, start[0]), (c0, c1, start[1])):
                moved = sum((after0[k] - before[k]).abs().sum().item() for k in after0)
                assert moved > 0 and sum((after1[k] - after0[k]).abs().sum().item() for k in after0) < 1e-3 * moved
