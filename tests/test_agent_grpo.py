"""agent_grpo.py: episodes with tool calls, token-exact, and the environment's tokens out of the update. A tiny random
Qwen2 with a Qwen2.5-format tool template of the tests' own (tests/lm_models.py) writes a scripted two-call episode:
its logits favor the script's next token by a margin (greedy sampling follows it, with log-probs far from 0), so the
ids the update trains on, the mask and the log-probs are checked against the script, computed here."""
import json
import math
import random
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_one_line_error, only_run_dir, read_scalars, run_script
from lm_models import CHATML, CHATML_TOOLS, make_model, make_tokenizer

import agent_grpo as ag

SCHEMAS = ag.tool_schemas({"multiply": ag.multiply})


def reward_terms_of(functions, weights, names):
    """The RewardTerms of a test: the reward functions called in this process, as by default."""
    return ag.RewardTerms(functions, weights, None, names, ag.RewardGuard([n for n, _ in functions], 120.0, 3, []))


# ------------------------------------------------------------------------- the math and the tools, by hand
def test_episode_tokens_by_hand():
    turns = [([5, 6, 7], True, [-0.5, -1.25, -2.0]), ([8, 9], False, None), ([10], True, [-0.75])]
    ids, mask, logprobs = ag.episode_tokens(turns)
    assert ids == [5, 6, 7, 8, 9, 10]
    assert mask == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert logprobs == [-0.5, -1.25, -2.0, 0.0, 0.0, -0.75]


def qwen_tokenizer(kind):
    """A tiny tokenizer of Qwen2.5's tool format ("tools") or Qwen3.5's ("tools_xml"), its response template set as
    main sets it (check_tool_template), and its stop ids."""
    tokenizer = make_tokenizer(kind)
    stop_ids = ag.stop_token_ids(tokenizer)
    ag.check_tool_template(tokenizer, SCHEMAS, stop_ids, kind)
    return tokenizer, stop_ids


def sampled_turn(tokenizer, message):
    """(the ids of an assistant turn as the template writes it after the generation prompt, that prompt's ids)."""
    user = [{"role": "user", "content": "12*34"}]
    prefix = ag.render_chat(tokenizer, user, add_generation_prompt=True, tools=SCHEMAS)
    full = ag.render_chat(tokenizer, user + [message], tools=SCHEMAS)
    assert full[: len(prefix)] == prefix
    return full[len(prefix) :], prefix


def test_qwen35s_calls_are_typed_by_the_schema_and_the_built_in_tool_gets_integers():
    """Qwen3.5's format writes each argument as text (12 and "12" alike): the parse types it by the tool's schema, as
    TRL's parse_response(tools=...), so multiply gets 12 and 34 and answers 408. The generation prompt pre-writes
    <think>: anchored at the prompt, the turn's reasoning is `reasoning_content`, not content."""
    tokenizer, _ = qwen_tokenizer("tools_xml")
    message = {"role": "assistant", "content": "", "reasoning_content": "two factors",
               "tool_calls": [call("multiply", a=12, b=34)]}
    ids, prefix = sampled_turn(tokenizer, message)
    assert "<parameter=a>\n12\n</parameter>" in tokenizer.decode(ids)  # written as text
    parsed = ag.parse_turn(tokenizer, ids, prefix, SCHEMAS)
    assert parsed["tool_calls"] == [call("multiply", a=12, b=34)] and type(parsed["tool_calls"][0]["function"]["arguments"]["a"]) is int
    assert parsed["reasoning_content"] == "two factors" and parsed["content"] == ""
    assert ag.call_tool({"multiply": ag.multiply}, parsed["tool_calls"][0], 1.0) == ("408", False)
    untyped = ag.parse_turn(tokenizer, ids, prefix, None)  # no schemas: text, which multiply refuses
    assert untyped["tool_calls"][0]["function"]["arguments"] == {"a": "12", "b": "34"}
    assert ag.parse_turn(tokenizer, ids, [], SCHEMAS)["content"] == "two factors\n</think>"  # unanchored: in content


def test_qwen25s_calls_are_typed_by_the_schema_and_a_call_that_is_not_json_is_text():
    """Qwen2.5's JSON format: a string "12" for an integer parameter is 12, as in TRL; a call that does not parse
    (not JSON, or cut short) leaves the turn's text and no call (TRL's fallback), so the episode ends with it."""
    tokenizer, stop_ids = qwen_tokenizer("tools")
    ids, prefix = sampled_turn(tokenizer, {"role": "assistant", "content": "I will call.",
                                           "tool_calls": [call("multiply", a="12", b=34)]})
    assert '"a": "12"' in tokenizer.decode(ids)
    parsed = ag.parse_turn(tokenizer, ids, prefix, SCHEMAS)
    assert parsed["tool_calls"] == [call("multiply", a=12, b=34)] and parsed["content"] == "I will call."
    for text in ('<tool_call>\n{"name": "multiply", "arguments": {"a": 3}\n</tool_call>',  # not JSON
                 '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 7}}'):  # cut short
        ids = tokenizer.encode(text, add_special_tokens=False) + [stop_ids[-1]]
        assert ag.parse_turn(tokenizer, ids, prefix, SCHEMAS) == {"role": "assistant", "content": text}, text
    plain = tokenizer.encode("It is 408.", add_special_tokens=False) + [stop_ids[-1]]
    assert ag.parse_turn(tokenizer, plain, prefix, SCHEMAS) == {"role": "assistant", "content": "It is 408."}
    own = {"defaults": {"role": "assistant"}, "fields": {"content": {"content": "text"}}}
    tokenizer.response_template = own
    assert ag.response_template_of(tokenizer, SCHEMAS, stop_ids) is own  # a tokenizer's own is used as is


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_call_tool_results_and_each_failure_as_trls_error_result():
    """The result is str() of the return value; a failure is str({"error": message}) with TRL's messages."""
    def slow(x: int) -> int:
        time.sleep(5)
        return x

    def lookup(key: str) -> dict:
        return {"key": key, "value": 7}

    tools = {"multiply": ag.multiply, "slow": slow, "lookup": lookup}
    assert ag.call_tool(tools, call("multiply", a=12, b=34), 1.0) == ("408", False)
    assert ag.call_tool(tools, call("lookup", key="k"), 1.0) == ("{'key': 'k', 'value': 7}", False)  # str(), as TRL
    failures = {"Tool divide not found.": call("divide", a=1, b=2),
                "multiply() got an unexpected keyword argument 'c'": call("multiply", a=1, c=2),  # bad arguments
                "multiply takes two integers, not '12' and 3": call("multiply", a="12", b=3),  # the tool raises
                "timed out after 0.05 s": call("slow", x=1)}
    for words, failing in failures.items():
        start = time.time()
        content, failed = ag.call_tool(tools, failing, 0.05)
        assert failed and content == str({"error": words}), (words, content)
        assert time.time() - start < 1.0  # a call that hangs costs its timeout, no more


# ------------------------------------------------------------------------- a scripted two-call episode
class ScriptedLM(torch.nn.Module):
    """A tiny random Qwen2 (the real architecture and its KV cache) whose next-token logits at position p get +6 (`margin`)
    on script[p + 1]: greedy sampling writes the script, each token with a probability far from 1. Positions count real
    tokens (left padding does not shift them), so the script holds in `generate` and in the update's forward alike."""

    def __init__(self, vocab_size, script, positions=1024, seed=0, margin=6.0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = make_model("qwen2", vocab_size, max_position_embeddings=positions)
        self.config, self.script, self.margin = self.model.config, torch.tensor(script), margin

    @property
    def device(self):
        return self.model.device

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        at = position_ids[:, -out.logits.shape[1] :] + 1
        following = self.script[at.clamp(max=len(self.script) - 1)]
        out.logits = out.logits + self.margin * torch.nn.functional.one_hot(following, out.logits.shape[-1])
        return out


def args_of(**overrides):
    fields = {f: getattr(ag.Args, f) for f in ag.Args.__dataclass_fields__ if hasattr(ag.Args, f)}
    return SimpleNamespace(**{**fields, "tools": (), "reward_fn": (), "reward_weights": (), "bf16": False,
                              "num_generations": 2, "batch_size": 2, "max_completion_length": 256, "max_prompt_length": 64,
                              "mini_batch_size": 2, **overrides})


def scripted_episode():
    """(tokenizer, stop ids, prompt ids, script, the policy turns' spans in the script): 12*34*5 in two calls; the answer's
    text written one character a token, which the tokenizer would encode in fewer (merged) tokens."""
    tokenizer, stop_ids = qwen_tokenizer("tools")
    messages = [{"role": "user", "content": "12*34*5"},
                {"role": "assistant", "content": "", "tool_calls": [call("multiply", a=12, b=34)]},
                {"role": "tool", "name": "multiply", "content": "408"},
                {"role": "assistant", "content": "", "tool_calls": [call("multiply", a=408, b=5)]},
                {"role": "tool", "name": "multiply", "content": "2040"}]
    prompt = ag.render_chat(tokenizer, messages[:1], add_generation_prompt=True, tools=SCHEMAS)
    script, spans = list(prompt), []
    for i in (1, 3):
        start = len(ag.render_chat(tokenizer, messages[:i], add_generation_prompt=True, tools=SCHEMAS))
        assert ag.render_chat(tokenizer, messages[:i], add_generation_prompt=True, tools=SCHEMAS) == script
        turn = ag.render_chat(tokenizer, messages[: i + 1], tools=SCHEMAS)[start:]
        turn = turn[: next(j for j, t in enumerate(turn) if t in stop_ids) + 1]  # up to the end of turn, sampled
        script += turn
        spans.append((start, len(script)))
        script = ag.render_chat(tokenizer, messages[: i + 2], add_generation_prompt=True, tools=SCHEMAS)
    answer = [t for c in "It is 2040." for t in tokenizer.encode(c, add_special_tokens=False)] + [stop_ids[-1]]
    assert len(tokenizer.encode("It is 2040.", add_special_tokens=False)) < len(answer) - 1  # the tokenizer merges
    spans.append((len(script), len(script) + len(answer)))
    return tokenizer, stop_ids, prompt, script + answer, spans


@pytest.fixture(scope="module")
def episode():
    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    policy = ScriptedLM(len(tokenizer), script).eval()
    env = ag.Harness(tokenizer, {"multiply": ag.multiply}, SCHEMAS, stop_ids)
    rows = [{"prompt": [{"role": "user", "content": "12*34*5"}], "target": "2040"}] * 2
    terms = reward_terms_of([("exact_match", ag.exact_match)], (1.0,), ["exact_match"])
    args = args_of(max_completion_length=len(script) - len(prompt) + 5, temperature=1.0)
    with torch.no_grad():
        batch = ag.sample_episodes(policy, env, rows, [prompt, prompt], terms, args, greedy=True)
    return SimpleNamespace(batch=batch, policy=policy, script=script, spans=spans, prompt=prompt, args=args,
                           tokenizer=tokenizer, terms=terms)


def test_an_episode_with_two_calls_is_the_script_token_for_token(episode):
    """The trained ids are the prompt and the turns' ids, concatenated: the policy's turns as sampled (the answer's
    unmerged tokens too: no turn is decoded and encoded again) and the tool turns as the template renders them."""
    batch, width = episode.batch, episode.batch.context_length
    assert width == len(episode.prompt)
    assert batch.sequences[0][batch.attention_mask[0].bool()].tolist() == episode.script
    assert batch.counts[0].tolist()[:3] == [2, 0, 3]  # two calls, none failed, three turns of the policy
    assert [m["content"] for m in batch.conversations[0] if m["role"] == "tool"] == ["408", "2040"]
    assert batch.conversations[0][-1] == {"role": "assistant", "content": "It is 2040."}
    assert batch.has_stop.all() and batch.rewards.tolist() == [0.0, 0.0]  # "It is 2040." is not exactly "2040"


def test_the_mask_is_one_on_the_tokens_the_policy_sampled_and_zero_on_the_rest(episode):
    batch, width = episode.batch, episode.batch.context_length
    expected = torch.zeros(len(episode.script) - width)
    for start, end in episode.spans:
        expected[start - width : end - width] = 1.0
    assert 0 < expected.sum() < len(expected)  # both kinds of token are there
    assert batch.mask[0, : len(expected)].tolist() == expected.tolist()
    assert batch.loss_mask.equal(batch.mask)
    assert batch.num_tokens == 2 * expected.sum().item()  # dapo's N: the policy tokens of both episodes
    # each tool turn begins with the template's separator after the policy's <|im_end|> ("\n"), not with <|im_start|>
    tool_start = episode.spans[0][1]
    assert episode.tokenizer.decode(episode.script[tool_start - 1 : tool_start + 2]) == "<|im_end|>\n<|im_start|>"
    assert batch.mask[0, tool_start - width - 1 : tool_start - width + 1].tolist() == [1.0, 0.0]


def test_the_updates_logprobs_at_step_0_are_the_samplers(episode):
    """Ratio 1 at lag 0: log π_θ of each policy token in the update's forward pass (the whole episode at once)
    equals the log-prob `generate` drew it with (turn by turn, with a KV cache), within float tolerance."""
    batch = episode.batch
    with torch.no_grad():
        logprobs, _ = ag.policy_logprobs(episode.policy, batch.sequences, batch.attention_mask, batch.context_length, 1.0)
    on = batch.mask.bool()
    assert torch.allclose(logprobs[on], batch.sampler_logprobs[on], atol=1e-5)
    assert logprobs[on].max() < -0.01  # not trivially 0: the script's tokens are likely, not certain
    assert (batch.sampler_logprobs[~on] == 0).all()


def test_no_environment_token_reaches_the_loss_the_kl_or_the_statistics(episode):
    """The update as main computes it, on the scripted episodes: the gradient of the policy loss and of the KL
    penalty is 0 at every environment token and not at the policy's, for each loss type; the entropy and length
    statistics count the policy's tokens only."""
    batch, args = episode.batch, episode.args
    env_tokens = (batch.attention_mask[:, batch.context_length :] == 1) & ~batch.mask.bool()
    assert env_tokens.any()
    for loss_type in ("grpo", "dapo", "dr_grpo"):
        args = args_of(**{**vars(episode.args), "loss_type": loss_type, "beta": 0.1, "epsilon_high": 0.28})
        with torch.no_grad():
            old_logprobs, entropy = ag.policy_logprobs(episode.policy, batch.sequences, batch.attention_mask,
                                                       batch.context_length, 1.0)
        ref_logprobs = old_logprobs - 0.3  # a reference that differs at every token
        old = ag.OldPolicy(old_logprobs, entropy, ref_logprobs, None, None)
        logprobs = (old_logprobs + 0.05).requires_grad_()  # a step away from π_old: ratios are not 1
        advantages, mb = torch.tensor([1.0, -0.5]), torch.arange(2)
        per_token = ag.clipped_surrogate(torch.exp(logprobs - old.logprobs), advantages, 0.2, 0.28)
        loss = ag.aggregate_loss(per_token, batch.loss_mask, loss_type, 2, batch.num_tokens, args.max_completion_length)
        loss = loss + ag.kl_to_reference(logprobs, ref_logprobs, batch.loss_mask, mb, batch.num_tokens,
                                         args.max_completion_length, args)
        loss.backward()
        assert (logprobs.grad[env_tokens] == 0).all(), loss_type
        assert (logprobs.grad[batch.mask.bool()] != 0).all(), loss_type
    # π_old and π_ref as main computes them (old_policy), the reference another scripted model, and the statistics
    ref = ScriptedLM(len(episode.tokenizer), episode.script, seed=1).eval()

    def logprobs_of(model, sequences, attention_mask, context_length):
        return ag.forward_in_chunks(lambda s, a: ag.policy_logprobs(model, s, a, context_length, 1.0), 2,
                                    sequences, attention_mask)

    with torch.no_grad():
        old = ag.old_policy(episode.policy, ref, batch, logprobs_of, args)
        ref_logprobs, _ = ag.policy_logprobs(ref, batch.sequences, batch.attention_mask, batch.context_length, 1.0)
    logged = {}
    writer = SimpleNamespace(add_scalar=lambda tag, value, step: logged.__setitem__(tag, value))
    stats = dict.fromkeys(("policy_loss", "kl_penalty", "clipped_low", "clipped_high", "first_ratio_max_error",
                           "policy_entropy"), 0.0)
    ag.log_agent_iteration(writer, 1, batch, old, stats, episode.terms, 1e-3, time.time() - 1, args)
    on = batch.mask.bool()
    assert logged["objective/completion_length"] == pytest.approx(on.sum().item() / 2)
    assert logged["objective/entropy"] == pytest.approx(entropy[on].sum().item() / 2)
    assert logged["objective/kl"] == pytest.approx((old_logprobs - ref_logprobs)[on].sum().item() / 2, rel=1e-4)
    assert logged["tools/tool_tokens"] == env_tokens[0].sum().item() and logged["tools/call_count"] == 2


def test_main_gives_the_loss_and_the_kl_the_sampled_tokens_only(tmp_path, monkeypatch):
    """One iteration of main with the scripted models (a margin that makes sampling follow the script, so every
    episode makes its two calls, each in the tool worker): every mask and normalizer the loop gives the policy loss
    and the KL penalty counts the policy's tokens of the batch sampled, never the environment's."""
    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    policy, ref = (ScriptedLM(len(tokenizer), script, seed=seed, margin=30.0) for seed in (0, 1))
    row = {"prompt": [{"role": "user", "content": "12*34*5"}], "target": "2040"}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ag, "load_models", lambda args, device: (tokenizer, stop_ids, policy, ref))
    monkeypatch.setattr(ag, "load_data", lambda *a: ([dict(row) for _ in range(8)], [dict(row) for _ in range(2)]))
    monkeypatch.setattr(ag, "save_dtype_of", lambda *a: torch.float32)
    monkeypatch.setattr(ag, "save_model", lambda *a: None)
    batches, losses, kl_masks, workers = [], [], [], []
    sample, aggregate, kl, call_tool = ag.sample_episodes, ag.aggregate_loss, ag.kl_to_reference, ag.call_tool
    monkeypatch.setattr(ag, "call_tool", lambda tools, call, timeout, worker=None: workers.append(worker)
                        or call_tool(tools, call, timeout, worker))
    monkeypatch.setattr(ag, "sample_episodes", lambda *a, **k: batches.append(sample(*a, **k)) or batches[-1])
    monkeypatch.setattr(ag, "aggregate_loss", lambda losses_, mask, kind, n_seq, n_tok, length:
                        losses.append((mask, n_tok)) or aggregate(losses_, mask, kind, n_seq, n_tok, length))
    monkeypatch.setattr(ag, "kl_to_reference", lambda lp, ref_lp, mask, *a: kl_masks.append(mask) or kl(lp, ref_lp, mask,
                                                                                                        *a))
    args = ag.Args(num_iterations=1, batch_size=4, mini_batch_size=2, num_generations=2, ppo_epochs=1, eval_size=2,
                   max_completion_length=len(script) - len(prompt) + 5, max_prompt_length=len(prompt), beta=0.1,
                   cuda=False, bf16=False, progress=False, output_dir=str(tmp_path / "out"))
    ag.main(args)
    train = next(b for b in batches if len(b.conversations) == 4)
    assert (train.counts[:, 0] == 2).all()  # each episode made its two calls
    assert workers and all(isinstance(w, ag.Worker) for w in workers)  # --tools' calls ran in the worker process
    env_tokens = (train.attention_mask[:, train.context_length :] == 1) & (train.mask == 0)
    assert env_tokens.sum(1).min() > 0 and train.loss_mask.equal(train.mask)
    assert len(kl_masks) == 2 and all(mask.equal(train.mask) for mask in kl_masks)
    policy_tokens = train.mask.sum().item()
    assert len(losses) == 4 and sum(mask.sum().item() for mask, _ in losses) == 2 * policy_tokens  # loss, KL: 2 each
    assert all(n == policy_tokens / 2 for _, n in losses)  # dapo's N: the policy's tokens per minibatch


def test_one_update_raises_the_rewarded_episodes_and_lowers_the_others(tmp_path, monkeypatch):
    """One iteration of main from the scripted model, sampled at temperature 1 with a margin that makes most episodes
    follow the script (two calls, no failure: a reward of 1) and some stray (0): measured from the model
    before and after, the policy's log-prob of its own tokens rises in the episodes with a positive advantage and
    falls in the others, Σ_i Â_i Δ log π(o_i) > 0."""
    import copy

    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    policy = ScriptedLM(len(tokenizer), script, margin=11.0)
    before = copy.deepcopy(policy).eval()
    row = {"prompt": [{"role": "user", "content": "12*34*5"}], "target": "2040"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text("def clean(prompts, completions, **columns):\n    return [float([m['content'][:9] "
                                         "for m in c if m['role'] == 'tool'] == ['408', '2040']) for c in completions]\n")
    monkeypatch.setattr(ag, "load_models", lambda args, device: (tokenizer, stop_ids, policy, None))
    monkeypatch.setattr(ag, "load_data", lambda *a: ([dict(row) for _ in range(8)], []))
    monkeypatch.setattr(ag, "save_dtype_of", lambda *a: torch.float32)
    monkeypatch.setattr(ag, "save_model", lambda *a: None)
    batches, sample = [], ag.sample_episodes
    monkeypatch.setattr(ag, "sample_episodes", lambda *a, **k: batches.append(sample(*a, **k)) or batches[-1])
    args = ag.Args(num_iterations=1, batch_size=16, mini_batch_size=16, num_generations=8, ppo_epochs=1, eval_size=0,
                   max_completion_length=len(script) - len(prompt) + 5, max_prompt_length=len(prompt), beta=0.0,
                   reward_fn=("rewards.py:clean",), lr=1e-3, cuda=False, bf16=False, progress=False,
                   output_dir=str(tmp_path / "out"))
    ag.main(args)
    batch = batches[0]
    assert 0 < batch.rewards.sum() < len(batch.rewards)  # both kinds of episode
    advantages = ag.compute_advantages(batch.rewards, 8)
    with torch.no_grad():
        new, old = (ag.policy_logprobs(model, batch.sequences, batch.attention_mask, batch.context_length, 1.0)[0]
                    for model in (policy, before))
    change = ((new - old) * batch.mask).sum(1)
    assert (advantages * change).sum() > 0
    assert (change[advantages > 0] > 0).float().mean() > 0.5 and (change[advantages < 0] < 0).float().mean() > 0.5


MULTIPLY = [{"multiply": ag.multiply}]
ROW = {"prompt": [{"role": "user", "content": "12*34*5"}], "target": "2040"}


def test_trls_overflow_rule_a_result_past_the_limit_ends_the_episode_one_that_fills_it_is_kept(episode):
    """TRL's rule (len(completion + result) > max_completion_length drops it): with room for the first result and not
    one token more, the result is kept and the episode ends with it, cut (has_stop false: the missing-EOS
    penalty); one token less, it is dropped and the episode ends after the policy's call, which ended with its stop
    token (has_stop true: scored)."""
    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    env = ag.Harness(tokenizer, {"multiply": ag.multiply}, SCHEMAS, stop_ids)
    terms = reward_terms_of([("exact_match", ag.exact_match)], (1.0,), ["exact_match"])
    filled = spans[1][0] - len(prompt)  # the first turn and its result, exactly
    for limit, kept in ((filled, True), (filled - 1, False)):
        args = args_of(max_completion_length=limit, missing_eos_penalty=-3.0)
        with torch.no_grad():
            batch = ag.sample_episodes(episode.policy, env, [ROW] * 2, [prompt] * 2, terms, args, greedy=True)
        real = batch.sequences[0][batch.attention_mask[0].bool()].tolist()
        assert real == script[: spans[1][0] if kept else spans[0][1]], limit
        assert [m["role"] for m in batch.conversations[0]] == (["assistant", "tool"] if kept else ["assistant"])
        assert batch.counts[0].tolist()[:3] == [1, 0, 1]
        assert batch.has_stop.tolist() == [not kept] * 2 and batch.rewards.tolist() == [-3.0 if kept else 0.0] * 2


def test_max_tool_calling_iterations_stops_the_calls(episode):
    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    env = ag.Harness(tokenizer, {"multiply": ag.multiply}, SCHEMAS, stop_ids)
    turns, _, counts = ag.run_episodes(episode.policy, env, [prompt], [[{"role": "user", "content": "12*34*5"}]],
                                       MULTIPLY, args_of(max_tool_calling_iterations=1), greedy=True)
    assert counts[0][:3] == [1, 0, 2] and len(turns[0]) == 3  # a call, its result, and a second call never run


# ------------------------------------------------------------------------- every step of an episode past its first turn
def test_the_reward_is_of_the_whole_conversation_and_its_final_answer(episode):
    """The reward functions get each episode's messages after the prompt, all five (three turns of the policy, two
    results), the answer last: a reward of 10 per tool result, plus 1 where the last answer says 2040, is 21."""
    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    env = ag.Harness(tokenizer, {"multiply": ag.multiply}, SCHEMAS, stop_ids)
    seen = []

    def whole(prompts, completions, target, **columns):
        seen.extend(completions)
        return [10.0 * sum(m["role"] == "tool" for m in c) + float(target[i] in c[-1]["content"])
                for i, c in enumerate(completions)]

    terms = reward_terms_of([("whole", whole)], (1.0,), ["whole"])
    with torch.no_grad():
        batch = ag.sample_episodes(episode.policy, env, [ROW] * 2, [prompt] * 2, terms, episode.args, greedy=True)
    assert [m["role"] for m in seen[0]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in seen[0] if m["role"] == "tool"] == ["408", "2040"]
    assert batch.rewards.tolist() == [21.0, 21.0]


def test_truncation_is_judged_on_the_last_turn(episode):
    """Two calls that each end with the stop token, then an answer cut at the limit: the episode is cut (has_stop
    false, the penalty), though every earlier turn stopped; with room for the answer's stop token it is scored."""
    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    env = ag.Harness(tokenizer, {"multiply": ag.multiply}, SCHEMAS, stop_ids)
    terms = reward_terms_of([("exact_match", ag.exact_match)], (1.0,), ["exact_match"])
    for cut, stopped in ((1, False), (0, True)):
        args = args_of(max_completion_length=len(script) - len(prompt) - cut, missing_eos_penalty=-2.5)
        with torch.no_grad():
            batch = ag.sample_episodes(episode.policy, env, [ROW] * 2, [prompt] * 2, terms, args, greedy=True)
        assert batch.counts[0].tolist()[:3] == [2, 0, 3]  # both calls ran, three turns
        assert batch.has_stop.tolist() == [stopped] * 2
        assert batch.rewards.tolist() == [0.0 if stopped else -2.5] * 2


def scripted_generate(tokenizer, rounds):
    """A stand-in for `generate`: in round r it writes rounds[r][j], a turn's text and its stop token, for the j-th
    episode still going, each token at log-prob -0.5."""
    rounds = iter(rounds)

    def fake(model, prompt_ids, pad, stop_ids, max_new_tokens, temperature=1.0, greedy=False):
        texts = next(rounds)
        assert len(texts) == len(prompt_ids)
        ids = [tokenizer.encode(text, add_special_tokens=False) + [stop_ids[-1]] for text in texts]
        width, length = max(map(len, prompt_ids)), max(map(len, ids))
        sequences = torch.tensor([[pad] * (width - len(p)) + p + i + [pad] * (length - len(i))
                                  for p, i in zip(prompt_ids, ids)])
        response_mask = torch.tensor([[1] * len(i) + [0] * (length - len(i)) for i in ids])
        return sequences, None, width, response_mask, -0.5 * response_mask.float()
    return fake


def test_the_g_episodes_of_a_prompt_are_its_group_whatever_order_they_finish_in(episode, monkeypatch):
    """Two prompts, G = 2: the first group's episodes end after 2 and 1 turns, the second's after 3 and 2. Each
    reward (10 × the calls, + the prompt's number) stays in its episode's row, and each group's advantages are its own:
    [+, −] and [+, −] by hand, whatever order the episodes ended in."""
    tokenizer, stop_ids, _, _, _ = scripted_episode()
    env = ag.Harness(tokenizer, {"multiply": ag.multiply}, SCHEMAS, stop_ids)
    c = '<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    monkeypatch.setattr(ag, "generate", scripted_generate(tokenizer, [[c, "6", c, c], ["6", c, "6"], ["6"]]))
    rows = [{"prompt": [{"role": "user", "content": f"{k}"}], "k": k} for k in (1, 1, 2, 2)]
    prompt_ids = [ag.render_chat(tokenizer, r["prompt"], add_generation_prompt=True, tools=SCHEMAS) for r in rows]

    def calls(prompts, completions, k, **columns):
        return [10.0 * sum(m["role"] == "tool" for m in c) + k_ for c, k_ in zip(completions, k)]

    terms = reward_terms_of([("calls", calls)], (1.0,), ["calls"])
    batch = ag.sample_episodes(episode.policy, env, rows, prompt_ids, terms, args_of(num_generations=2, batch_size=4))
    assert batch.counts[:, 2].tolist() == [2, 1, 3, 2]  # turns: the episodes end in rounds 2, 1, 3, 2
    assert batch.rewards.tolist() == [11.0, 1.0, 22.0, 12.0]
    root_half = 1 / math.sqrt(2)  # (r - mean) / std over a group of two values: ±1/√2 (std with G - 1)
    assert ag.compute_advantages(batch.rewards, 2).tolist() == pytest.approx([root_half, -root_half] * 2, abs=1e-4)


def main_with_scripted_models(tmp_path, monkeypatch, policy, ref, **overrides):
    """main on the scripted episode's prompt with these models; returns what it sampled, its π_old, and the calls of
    clipped_surrogate and kl_to_reference it made (their arguments, and kl_to_reference's value)."""
    tokenizer, stop_ids, prompt, script, _ = scripted_episode()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ag, "load_models", lambda args, device: (tokenizer, stop_ids, policy, ref))
    monkeypatch.setattr(ag, "load_data", lambda *a: ([dict(ROW) for _ in range(8)], []))
    monkeypatch.setattr(ag, "save_dtype_of", lambda *a: torch.float32)
    monkeypatch.setattr(ag, "save_model", lambda *a: None)
    seen = SimpleNamespace(batches=[], olds=[], surrogates=[], kls=[])
    sample, old_policy, surrogate, kl = ag.sample_episodes, ag.old_policy, ag.clipped_surrogate, ag.kl_to_reference
    monkeypatch.setattr(ag, "sample_episodes", lambda *a, **k: seen.batches.append(sample(*a, **k)) or seen.batches[-1])
    monkeypatch.setattr(ag, "old_policy", lambda *a: seen.olds.append(old_policy(*a)) or seen.olds[-1])
    monkeypatch.setattr(ag, "clipped_surrogate", lambda *a: seen.surrogates.append(a) or surrogate(*a))
    monkeypatch.setattr(ag, "kl_to_reference", lambda *a: seen.kls.append((a, kl(*a))) or seen.kls[-1][1])
    fields = dict(num_iterations=1, batch_size=4, mini_batch_size=2, num_generations=2, ppo_epochs=1, eval_size=0,
                  max_completion_length=len(script) - len(prompt) + 5, max_prompt_length=len(prompt), cuda=False,
                  bf16=False, progress=False, output_dir=str(tmp_path / "out"))
    ag.main(ag.Args(**{**fields, **overrides}))
    return seen


def test_the_updates_logprobs_are_at_the_samplers_temperature(tmp_path, monkeypatch):
    """Sampled at T = 0.5, three turns an episode: π_old's log-probs are the sampler's, log softmax(z / T), on every
    policy token of every turn, and the update's first ratio is exactly 1; at T = 1 they would differ."""
    tokenizer, _, _, script, _ = scripted_episode()
    policy = ScriptedLM(len(tokenizer), script, margin=6.0)
    seen = main_with_scripted_models(tmp_path, monkeypatch, policy, None, temperature=0.5, beta=0.0)
    batch, old, on = seen.batches[0], seen.olds[0], seen.batches[0].mask.bool()
    assert (batch.counts[:, 2] >= 1).all() and batch.counts[:, 2].max() >= 3  # episodes past their first turn
    assert torch.allclose(old.logprobs[on], batch.sampler_logprobs[on], atol=1e-5)
    with torch.no_grad():
        at_one, _ = ag.policy_logprobs(policy, batch.sequences, batch.attention_mask, batch.context_length, 1.0)
    assert (at_one[on] - batch.sampler_logprobs[on]).abs().max() > 0.1
    ratio = seen.surrogates[0][0]
    assert (ratio[on[:2]] - 1).abs().max() < 1e-5


def test_the_kl_reads_the_references_logprobs_of_the_same_rows(tmp_path, monkeypatch):
    """Every minibatch's KL penalty, in shuffled order (the second epoch), is β × grpo's mean of k3 between the
    policy's log-probs of its rows and the reference's log-probs of those same rows, computed here from the
    reference model; the episodes differ row by row, so any other row's would not do."""
    tokenizer, _, _, script, _ = scripted_episode()
    policy, ref = ScriptedLM(len(tokenizer), script, margin=5.0), ScriptedLM(len(tokenizer), script, seed=1, margin=4.0)
    seen = main_with_scripted_models(tmp_path, monkeypatch, policy, ref, beta=0.3, ppo_epochs=2)
    batch = seen.batches[0]
    assert len({tuple(row) for row in batch.sequences.tolist()}) > 2  # the rows differ
    with torch.no_grad():
        ref_logprobs, _ = ag.policy_logprobs(ref, batch.sequences, batch.attention_mask, batch.context_length, 1.0)
    orders = []
    for (logprobs, _, loss_mask, mb, *_), value in seen.kls:
        log_r = ref_logprobs[mb] - logprobs.detach()
        k3 = (log_r.exp() - 1 - log_r) * loss_mask[mb]
        expected = 0.3 * ((k3.sum(1) / loss_mask[mb].sum(1)).sum() / 2)
        assert value.item() == pytest.approx(expected.item(), rel=1e-5)
        orders.append(mb.tolist())
    assert len(orders) == 4 and sorted(sum(orders[2:], [])) == [0, 1, 2, 3] and sum(orders[2:], []) != [0, 1, 2, 3]


# ------------------------------------------------------------------------- --environment, TRL's environment_factory
ENVIRONMENTS_PY = '''
class Counter:
    """An episode's state: the calls it made."""

    def reset(self, target, **row):
        self.calls, self.target, self.resets = [], target, getattr(self, "resets", 0) + 1

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        self.calls.append((a, b))
        return a * b

    def get_reward(self) -> float:
        return 100.0 * len(self.calls) + float(self.target == "2040")

    def _helper(self):
        return 0


class Greeter(Counter):
    def reset(self, **row):
        super().reset(target="")
        return " Start in kzp."


class NoReset:
    def look(self, room: str) -> str:
        """Look.

        Args:
            room: a room
        """
        return room


class NoHints(Counter):
    def add(self, a, b):
        return a + b


class Raises(Counter):
    def __init__(self):
        raise RuntimeError("no database")


class ResetRaises(Counter):
    def reset(self, **row):
        raise KeyError("secret")


class ResetNumber(Counter):
    def reset(self, **row):
        return 7


class RewardNone(Counter):
    def get_reward(self):
        return None


class RewardAttribute(Counter):
    get_reward = 1.0


class NoTools:
    def reset(self, **row):
        return None


class Unrewarded(NoReset):
    def reset(self, **row):
        return None
'''


def environment_of(tmp_path, monkeypatch, name, **overrides):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs.py").write_text(ENVIRONMENTS_PY)
    return ag.load_episode_setup(args_of(environment=f"envs.py:{name}", **overrides))


def test_each_episode_has_its_own_instance_reset_with_its_row_and_get_reward_scores_it(episode, tmp_path, monkeypatch):
    """The environment's methods are the tools and get_reward() one more reward term, of weight 1 under the class's
    name (--reward-fn optional). Two episodes of one prompt, two calls each: each instance saw its own two calls
    (100 × 2 + 1 for the row's target), never its sibling's; the pool is reused, each instance reset once a batch."""
    tools, environment, functions, weights, _ = environment_of(tmp_path, monkeypatch, "Counter")
    assert tools == {} and [n for n, _ in functions] == ["Counter"] and weights == (1.0,)
    assert ag.tool_schemas(ag.environment_tools(environment[1])) == SCHEMAS  # its public method, as a tool
    tokenizer, stop_ids, prompt, _, _ = scripted_episode()
    harness = ag.Harness(tokenizer, tools, SCHEMAS, stop_ids, None, environment[0], [environment[1]])
    terms, args = reward_terms_of(functions, weights, ["Counter"]), args_of(**{**vars(episode.args),
                                                                                   "max_prompt_length": 512})
    for resets in (1, 2):
        with torch.no_grad():
            batch = ag.sample_episodes(episode.policy, harness, [ROW] * 2, [prompt] * 2, terms, args, greedy=True)
        assert batch.counts[:, 0].tolist() == [2, 2] and batch.rewards.tolist() == [201.0, 201.0]
        first, second = batch.environments
        assert first is not second and first.calls == [(12, 34), (408, 5)] and second.calls == first.calls
        assert first.resets == second.resets == resets and len(harness.pool) == 2
    assert batch.environments[0] is environment[1]  # the probe instance is the pool's first


def test_the_text_reset_returns_is_appended_to_the_last_user_message(tmp_path, monkeypatch):
    """TRL's rule: reset(**row)'s text is appended to the prompt's last user message, which is rendered with every
    tool's schema; the row itself is left as it was."""
    tools, environment, _, _, _ = environment_of(tmp_path, monkeypatch, "Greeter", tools=())
    tokenizer, stop_ids, _, _, _ = scripted_episode()
    harness = ag.Harness(tokenizer, tools, SCHEMAS, stop_ids, None, environment[0], [environment[1]])
    prompts, ids, instances = ag.reset_environments(harness, [dict(ROW)], 512)
    assert prompts == [[{"role": "user", "content": "12*34*5 Start in kzp."}]] and ROW["prompt"][0]["content"] == "12*34*5"
    assert ids == [ag.render_chat(tokenizer, prompts[0], add_generation_prompt=True, tools=SCHEMAS)]
    with pytest.raises(SystemExit, match="over --max-prompt-length 10"):
        ag.reset_environments(harness, [dict(ROW)], 10)


@pytest.mark.parametrize("name,overrides,words", [
    ("Missing", {}, ["no class 'Missing'"]),
    ("NoReset", {}, ["NoReset has no reset(self, **row) method"]),
    ("NoHints", {}, ["add:", "type hints and a docstring"]),
    ("Raises", {}, ["Raises() raised RuntimeError: no database"]),
    ("RewardAttribute", {}, ["get_reward must be a method"]),
    ("NoTools", {}, ["no public method"]),
    ("Counter", {"tools": ("tools.py:multiply",)}, ["'multiply' is also a --tools function"]),
    ("Unrewarded", {}, ["no get_reward()", "--reward-fn"]),
], ids=["no-class", "no-reset", "no-hints", "constructor-raises", "reward-not-a-method", "no-tools", "a-name-twice",
        "no-reward"])
def test_an_environment_that_does_not_load_is_one_line(tmp_path, monkeypatch, name, overrides, words):
    (tmp_path / "tools.py").write_text(TOOLS_PY + "\n\nfrom agent_grpo import multiply\n")
    with pytest.raises(SystemExit) as stop:
        environment_of(tmp_path, monkeypatch, name, **overrides)
    message = str(stop.value)
    assert message.startswith("error: ") and "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("name,words", [
    ("ResetRaises", ["ResetRaises.reset(**row) raised KeyError: 'secret'", "['prompt', 'target']"]),
    ("ResetNumber", ["ResetNumber.reset returned 7: None or text"]),
    ("RewardNone", ["RewardNone.get_reward() returned None: it must return a finite number"]),
], ids=["reset-raises", "reset-returns-a-number", "reward-returns-none"])
def test_an_environment_that_fails_on_the_first_row_is_one_line(tmp_path, monkeypatch, name, words):
    _, environment, _, _, _ = environment_of(tmp_path, monkeypatch, name)
    with pytest.raises(SystemExit) as stop:
        ag.check_environment(environment[1], dict(ROW))
    message = str(stop.value)
    assert message.startswith("error: ") and "\n" not in message and all(w in message for w in words), message


def test_without_a_dataset_the_rows_are_trls_empty_prompts_and_tools_add_up(tmp_path, monkeypatch):
    """Dataset-free training (TRL's: no train_dataset, max_steps): the rows are empty user messages that reset
    completes; --tools and --environment together give both sets of tools."""
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    tools, environment, functions, _, task_row = environment_of(tmp_path, monkeypatch, "Greeter", tools=("tools.py:add",))
    assert task_row(random.Random(0)) == {"prompt": [{"role": "user", "content": ""}]}
    assert list(tools) == ["add"] and list(tools | ag.environment_tools(environment[1])) == ["add", "multiply"]
    assert [n for n, _ in functions] == ["Greeter"]


# ------------------------------------------------------------------------- templates that cannot carry an episode
def test_a_template_that_renders_a_past_turn_again_is_refused():
    """A template that writes the last assistant turn otherwise than the earlier ones (as templates that drop
    past reasoning do): the tool turn's ids could not continue the sampled ones, so tool_turn_ids refuses."""
    tokenizer = make_tokenizer("tools")
    stop_ids = ag.stop_token_ids(tokenizer)
    messages = [{"role": "user", "content": "12*34"}, {"role": "assistant", "content": "", "tool_calls": [call("multiply", a=12, b=34)]}]
    reply = [{"role": "tool", "name": "multiply", "content": "408"}]
    assert ag.tool_turn_ids(tokenizer, messages, reply, SCHEMAS, stop_ids) is not None
    tokenizer.chat_template = CHATML_TOOLS.replace("{{ m['content'] or '' }}", "{{ m['content'] or '' }}{{ '.' if loop.last }}")
    assert ag.tool_turn_ids(tokenizer, messages, reply, SCHEMAS, stop_ids) is None


def save_tiny_qwen(path, template=CHATML_TOOLS):
    tokenizer = make_tokenizer("tools")
    tokenizer.chat_template = template
    torch.manual_seed(0)
    model = make_model("qwen2", len(tokenizer), max_position_embeddings=1024)
    model.config.eos_token_id = model.config.pad_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


TOOLS_PY = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def no_hints(a, b):
    return a + b
'''


@pytest.mark.slow
def test_a_tiny_qwen_trains_with_a_tool_of_the_users_and_logs_the_tools(tmp_path):
    """The real-model path, offline: a tiny random Qwen2 with a Qwen2.5-format tool template, a dataset of
    conversational prompts, a tool from a file and a reward from a file. Two iterations run and log the tools."""
    model = save_tiny_qwen(tmp_path / "qwen")
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    (tmp_path / "rewards.py").write_text("def long(prompts, completions, **columns):\n"
                                         "    return [float(len(c[-1]['content'])) / 10 for c in completions]\n")
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{i}+{i + 1}"}]}) + "\n")
    proc = run_script("agent_grpo.py", "--model-name-or-path", model, "--dataset-name", "data.jsonl", "--tools",
                      "tools.py:add", "--reward-fn", "rewards.py:long", "--num-iterations", "2", "--batch-size", "8",
                      "--mini-batch-size", "4", "--num-generations", "4", "--max-completion-length", "24",
                      "--max-prompt-length", "512", "--eval-every", "2", "--eval-size", "4", "--output-dir", "out",
                      "--no-cuda", cwd=tmp_path)
    assert "tools: add" in proc.stdout and (tmp_path / "out" / "config.json").exists()
    logs = read_scalars(only_run_dir(tmp_path))
    for tag in ("tools/call_count", "tools/failure_count", "tools/turns", "objective/reward", "eval/call_count"):
        assert len(logs[tag]) == 2, tag  # two iterations; two evaluations (before the first, after the last)
    assert all(value == 0 for _, value in logs["policy/first_ratio_max_error"])


@pytest.mark.slow
def test_a_tiny_qwen_trains_in_an_environment_without_a_dataset(tmp_path):
    """TRL's dataset-free training through the script: no --dataset-name, the environment's reset writes each prompt,
    its method is the tool, its get_reward the reward (no --reward-fn), logged under the class's name."""
    model = save_tiny_qwen(tmp_path / "qwen")
    (tmp_path / "envs.py").write_text(ENVIRONMENTS_PY + '''

class Prompter(Counter):
    def reset(self, **row):
        super().reset(target="12")
        return "Multiply 3 by 4."
''')
    proc = run_script("agent_grpo.py", "--model-name-or-path", model, "--environment", "envs.py:Prompter",
                      "--num-iterations", "2", "--batch-size", "4", "--mini-batch-size", "4", "--num-generations", "2",
                      "--max-completion-length", "16", "--max-prompt-length", "512", "--eval-every", "2",
                      "--eval-size", "2", "--output-dir", "out", "--no-cuda", cwd=tmp_path)
    assert "tools: multiply" in proc.stdout and "its environment's state at the end: {'calls': [" in proc.stdout
    logs = read_scalars(only_run_dir(tmp_path))
    assert len(logs["rewards/Prompter"]) == 2 and (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("spec,words", [
    ("missing.py:add", ["missing.py", "does not exist"]),
    ("tools.py:no_hints", ["no_hints", "type hints and a docstring"]),
    ("tools.py:subtract", ["no function 'subtract'"]),
    ("broken.py:f", ["importing 'broken.py' failed", "ZeroDivisionError"]),
    ("tools.py", ["MODULE_OR_FILE:NAME"]),
], ids=["no-file", "no-hints", "no-function", "raises", "no-name"])
def test_a_tool_that_does_not_load_is_one_line(tmp_path, monkeypatch, spec, words):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    (tmp_path / "broken.py").write_text("1 / 0\n")
    with pytest.raises(SystemExit) as stop:
        ag.load_tools([spec])
    message = str(stop.value)
    assert message.startswith("error: ") and "\n" not in message and all(w in message for w in words), message
    assert list(ag.load_tools(["tools.py:add"])) == ["add"]


@pytest.mark.slow
@pytest.mark.parametrize("flags,words", [
    ([], ["does not render tools"]),  # the model's template: ChatML without tools
    (["--dataset-name", "no_prompts.jsonl", "--tools", "tools.py:add", "--reward-fn", "exact_match"],
     ["needs a `prompt` column"]),
], ids=["no-tool-template", "no-prompts"])
def test_bad_input_is_one_line(tmp_path, flags, words):
    """Through the script, before any work: a template without tool support, a dataset without prompts."""
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    (tmp_path / "no_prompts.jsonl").write_text('{"question": "1+2", "target": "3"}\n' * 20)
    model = save_tiny_qwen(tmp_path / "qwen", CHATML if not flags else CHATML_TOOLS)
    proc = run_script("agent_grpo.py", "--model-name-or-path", model, *flags, "--no-cuda", cwd=tmp_path, check=False)
    assert_one_line_error(proc, *words)


def test_the_demonstrations_are_data_sft_trains_on_the_assistants_turns_of(tmp_path, capsys):
    """--write-sft-data's file, read as sft.py reads it: every row passes sft.py's checks, and with its built-in
    byte tokenizer and chat template the labeled tokens are the assistant's turns (the calls and the answer, each
    with its stop token), never a tool's result or the template's headers."""
    import sft

    ag.write_demonstrations(str(tmp_path / "tools.jsonl"), 1, ag.demonstration, n=40)
    assert "wrote 40 demonstrations" in capsys.readouterr().out
    data, _ = sft.read_json_rows(str(tmp_path / "tools.jsonl"))
    tokenizer = sft.make_tokenizer(None)
    stop_ids = sft.stop_token_ids(tokenizer)
    for row in data["train"]:
        assert sft.row_problem(row, ("messages",)) is None
        ids, labels = sft.tokenize(row, tokenizer, stop_ids)
        labeled = tokenizer.decode([t for t in labels if t != -100])
        turns = [m for m in row["messages"] if m["role"] == "assistant"]
        assert labeled.count("</s>") == len(turns) and "tool:" not in labeled and "assistant:" not in labeled
        assert labeled.endswith(turns[-1]["content"] + "</s>")


def test_the_built_in_task_and_its_demonstrations():
    """Products of two or three factors; a demonstration calls the tool once per factor after the first, on the last
    result, and answers with it; its slips are the ones documented, about as often."""
    rows = ag.task_rows(1, "train", 2000, ag.tool_task_row)
    factors = [[int(x) for x in row["prompt"][0]["content"].split("*")] for row in rows]
    assert all(row["target"] == str(math.prod(f)) for row, f in zip(rows, factors))
    assert 0.4 < sum(len(f) == 3 for f in factors) / len(factors) < 0.6
    demos = [ag.demonstration(random.Random(i)) for i in range(2000)]
    guesses = [d for d in demos if len(d["messages"]) == 2]
    assert 0.06 < len(guesses) / len(demos) < 0.14 and all(d["tools"] == SCHEMAS for d in demos)
    right = 0
    for d in demos:
        factors = [int(x) for x in d["messages"][0]["content"].split("*")]
        results = [m["content"] for m in d["messages"] if m["role"] == "tool" and "error" not in m["content"]]
        if len(d["messages"]) > 2:
            assert len(results) == len(factors) - 1 and d["messages"][-1]["content"] == results[-1]
        right += d["messages"][-1]["content"] == str(math.prod(factors))
    assert 0.6 < right / len(demos) < 0.85


def test_the_treasure_hunt_needs_each_calls_result_for_the_next_and_rewards_the_opened_chest():
    """The built-in stateful task: the code is only in the environment; a look's note names the next room; unlock
    takes one try (an integer); a wrong room or a second try is an error result; get_reward is 1 on the chest opened."""
    row = {"prompt": [{"role": "user", "content": "Open the chest."}], "start": "12",
           "rooms": [["12", "go to 34"], ["34", "code 4721"]], "target": "4721"}
    hunt = ag.TreasureHunt()
    assert hunt.reset(**row) == " Start in 12." and hunt.get_reward() == 0.0
    tools = ag.environment_tools(hunt)
    assert list(tools) == ["look", "unlock"]
    assert ag.call_tool(tools, call("look", room=12), 1.0) == ("go to 34", False)
    assert ag.call_tool(tools, call("look", room=35), 1.0) == (str({"error": "there is no room 35"}), True)
    assert ag.call_tool(tools, call("look", room=34), 1.0) == ("code 4721", False)
    assert ag.call_tool(tools, call("unlock", code=4721), 1.0) == ("opened 4721", False) and hunt.get_reward() == 1.0
    assert ag.call_tool(tools, call("unlock", code=4721), 1.0)[1]  # one try
    hunt.reset(**row)
    assert ag.call_tool(tools, call("unlock", code=4722), 1.0) == ("locked 4722", False)
    assert hunt.get_reward() == 0.0 and ag.call_tool(tools, call("unlock", code=4721), 1.0)[1]
    hunt.reset(**row)
    for _ in range(6):
        ag.call_tool(tools, call("look", room=12), 1.0)
    assert ag.call_tool(tools, call("look", room=12), 1.0) == (str({"error": "out of moves"}), True)
    rows = ag.task_rows(1, "train", 2000, ag.hunt_task_row)
    assert 0.4 < sum(len(r["rooms"]) == 2 for r in rows) / len(rows) < 0.6
    assert all(r["rooms"][0][0] == r["start"] and r["rooms"][-1][1] == f"code {r['target']}" for r in rows)


def test_the_hunts_demonstrations_slip_as_documented_and_sft_trains_on_them(tmp_path):
    """--write-sft-data --environment treasure_hunt: episodes in TRL's format whose tool results are the
    environment's own; about 1 in 10 a guess without a look, 7 in 10 to 9 in 10 opening the chest, and the answer the
    code tried."""
    import sft

    demos = [ag.hunt_demonstration(random.Random(i)) for i in range(2000)]
    assert all(d["tools"] == ag.tool_schemas(ag.environment_tools(ag.TreasureHunt())) for d in demos)
    guesses = [d for d in demos if [m["tool_calls"][0]["function"]["name"] for m in d["messages"]
                                    if m.get("tool_calls")] == ["unlock"]]
    assert 0.06 < len(guesses) / len(demos) < 0.14
    opened = [d for d in demos if d["messages"][-2]["content"].startswith("opened")]
    assert 0.7 < len(opened) / len(demos) < 0.9
    assert all(d["messages"][-1]["content"] == d["messages"][-2]["content"].split()[-1] for d in demos)  # the code
    ag.write_demonstrations(str(tmp_path / "hunt.jsonl"), 1, ag.hunt_demonstration, n=20)
    data, _ = sft.read_json_rows(str(tmp_path / "hunt.jsonl"))
    assert len(data["train"]) == 20 and all(sft.row_problem(row, ("messages",)) is None for row in data["train"])
