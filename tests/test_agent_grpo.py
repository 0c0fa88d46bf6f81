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


# ------------------------------------------------------------------------- the math and the tools, by hand
def test_episode_tokens_by_hand():
    turns = [([5, 6, 7], True, [-0.5, -1.25, -2.0]), ([8, 9], False, None), ([10], True, [-0.75])]
    ids, mask, logprobs = ag.episode_tokens(turns)
    assert ids == [5, 6, 7, 8, 9, 10]
    assert mask == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert logprobs == [-0.5, -1.25, -2.0, 0.0, 0.0, -0.75]


def test_parse_calls_in_qwens_format_and_the_malformed():
    content, calls = ag.parse_calls('I will call.<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 7}}\n'
                                    '</tool_call><tool_call>{"name":"f","arguments":"{\\"x\\": 1}"}</tool_call>')
    assert content == "I will call."
    assert [c["function"] for c in calls] == [{"name": "multiply", "arguments": {"a": 3, "b": 7}},
                                              {"name": "f", "arguments": {"x": 1}}]  # arguments as JSON text too
    assert not any("error" in c for c in calls)
    for text in ('<tool_call>{"name": "multiply", "arguments": {"a": 3}</tool_call>',  # not JSON
                 '<tool_call>{"arguments": {"a": 3}}</tool_call>',  # no name
                 '<tool_call>{"name": "multiply", "arguments": [3, 7]}</tool_call>',  # arguments not an object
                 '<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 7}}'):  # never closed: cut short
        _, calls = ag.parse_calls(text)
        assert len(calls) == 1 and "error" in calls[0], text
    assert ag.parse_calls("no call here, 42") == ("no call here, 42", [])


def test_parse_turn_takes_the_tokenizers_response_parser_where_it_has_one():
    """transformers 5's parse_response reads the calls where the tokenizer has a response template (any format);
    without one, parse_calls reads Qwen's; a parser that fails leaves the turn's text, with no calls."""
    calls = [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}]
    parser = SimpleNamespace(decode=lambda ids, skip_special_tokens: "[[multiply 2 3]]", response_template={},
                             parse_response=lambda text, prefix: {"content": "", "tool_calls": calls})
    assert ag.parse_turn(parser, [1, 2]) == {"role": "assistant", "content": "", "tool_calls": calls}
    failing = SimpleNamespace(**{**vars(parser), "parse_response": lambda text, prefix: 1 / 0})
    assert ag.parse_turn(failing, [1, 2]) == {"role": "assistant", "content": "[[multiply 2 3]]", "tool_calls": []}
    plain = SimpleNamespace(decode=lambda ids, skip_special_tokens: '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert ag.parse_turn(plain, [1])["tool_calls"][0]["function"] == {"name": "f", "arguments": {}}


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_call_tool_results_and_each_failure_as_an_error_result():
    def slow(x: int) -> int:
        time.sleep(5)
        return x

    def lookup(key: str) -> dict:
        return {"key": key, "value": 7}

    tools = {"multiply": ag.multiply, "slow": slow, "lookup": lookup}
    assert ag.call_tool(tools, call("multiply", a=12, b=34), 1.0) == ("408", False)
    assert ag.call_tool(tools, call("lookup", key="k"), 1.0) == ('{"key": "k", "value": 7}', False)  # JSON
    failures = {"unknown tool 'divide'": call("divide", a=1, b=2),
                "unexpected keyword argument 'c'": call("multiply", a=1, c=2),  # bad arguments
                "TypeError: multiply takes two integers": call("multiply", a="12", b=3),  # the tool raises
                "timed out after 0.05 s": call("slow", x=1),
                "not JSON": ag.parse_calls("<tool_call>{oops}</tool_call>")[1][0]}
    for words, failing in failures.items():
        start = time.time()
        content, failed = ag.call_tool(tools, failing, 0.05)
        assert failed and words in json.loads(content)["error"], (words, content)
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
                              "num_generations": 2, "batch_size": 2,
                              "mini_batch_size": 2, **overrides})


def scripted_episode():
    """(tokenizer, stop ids, prompt ids, script, the policy turns' spans in the script): 12*34*5 in two calls; the answer's
    text written one character a token, which the tokenizer would encode in fewer (merged) tokens."""
    tokenizer = make_tokenizer("tools")
    stop_ids = ag.stop_token_ids(tokenizer)
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
    env = ag.Environment(tokenizer, {"multiply": ag.multiply}, SCHEMAS, stop_ids)
    rows = [{"prompt": [{"role": "user", "content": "12*34*5"}], "target": "2040"}] * 2
    terms = ag.RewardTerms([("exact_match", ag.exact_match)], (1.0,), None, ["exact_match"])
    args = args_of(max_completion_length=len(script) - len(prompt) + 5, temperature=1.0)
    with torch.no_grad():
        batch = ag.sample_episodes(policy, env, rows, [prompt, prompt], terms, args, greedy=True)
    return SimpleNamespace(batch=batch, policy=policy, script=script, spans=spans, prompt=prompt, args=args,
                           tokenizer=tokenizer)


def test_an_episode_with_two_calls_is_the_script_token_for_token(episode):
    """The trained ids are the prompt and the turns' ids, concatenated: the policy's turns as sampled (the answer's
    unmerged tokens too: no turn is decoded and encoded again) and the tool turns as the template renders them."""
    batch, width = episode.batch, episode.batch.context_length
    assert width == len(episode.prompt)
    assert batch.sequences[0][batch.attention_mask[0].bool()].tolist() == episode.script
    assert batch.counts[0].tolist()[:3] == [2, 0, 3]  # two calls, none failed, three turns of the policy
    assert [m["content"] for m in batch.conversations[0] if m["role"] == "tool"] == ["408", "2040"]
    assert batch.conversations[0][-1] == {"role": "assistant", "content": "It is 2040.", "tool_calls": []}
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
    ag.log_agent_iteration(writer, 1, batch, old, stats, ["exact_match"], 1e-3, time.time() - 1, args)
    on = batch.mask.bool()
    assert logged["objective/completion_length"] == pytest.approx(on.sum().item() / 2)
    assert logged["objective/entropy"] == pytest.approx(entropy[on].sum().item() / 2)
    assert logged["objective/kl"] == pytest.approx((old_logprobs - ref_logprobs)[on].sum().item() / 2, rel=1e-4)
    assert logged["tools/tool_tokens"] == env_tokens[0].sum().item() and logged["tools/call_count"] == 2


def test_main_gives_the_loss_and_the_kl_the_sampled_tokens_only(tmp_path, monkeypatch):
    """One iteration of main with the scripted models (a margin that makes sampling follow the script, so every
    episode makes its two calls): every mask and normalizer the loop gives the policy loss and the KL penalty counts
    the policy's tokens of the batch sampled, never the environment's."""
    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    policy, ref = (ScriptedLM(len(tokenizer), script, seed=seed, margin=30.0) for seed in (0, 1))
    row = {"prompt": [{"role": "user", "content": "12*34*5"}], "target": "2040"}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ag, "load_models", lambda args, device: (tokenizer, stop_ids, policy, ref))
    monkeypatch.setattr(ag, "load_data", lambda *a: ([dict(row) for _ in range(8)], [dict(row) for _ in range(2)]))
    monkeypatch.setattr(ag, "save_dtype_of", lambda *a: torch.float32)
    monkeypatch.setattr(ag, "save_model", lambda *a: None)
    batches, losses, kl_masks = [], [], []
    sample, aggregate, kl = ag.sample_episodes, ag.aggregate_loss, ag.kl_to_reference
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
    policy = ScriptedLM(len(tokenizer), script, margin=12.0)
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


def test_a_tool_result_that_would_not_fit_ends_the_episode(episode):
    """TRL's rule: with room for the first call but not its result, the result is dropped and the episode ends
    after the policy's first turn, which is kept whole."""
    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    env = ag.Environment(tokenizer, {"multiply": ag.multiply}, SCHEMAS, stop_ids)
    args = args_of(max_completion_length=spans[0][1] - len(prompt) + 3)
    user = [{"role": "user", "content": "12*34*5"}]
    turns, conversations, counts = ag.run_episodes(episode.policy, env, [prompt], [user], args, greedy=True)
    assert len(turns[0]) == 1 and turns[0][0][0] == script[len(prompt) : spans[0][1]]
    assert counts[0][:3] == [1, 0, 1] and conversations[0][0]["tool_calls"]


def test_max_tool_calling_iterations_stops_the_calls(episode):
    tokenizer, stop_ids, prompt, script, spans = scripted_episode()
    env = ag.Environment(tokenizer, {"multiply": ag.multiply}, SCHEMAS, stop_ids)
    turns, _, counts = ag.run_episodes(episode.policy, env, [prompt], [[{"role": "user", "content": "12*34*5"}]],
                                       args_of(max_tool_calling_iterations=1), greedy=True)
    assert counts[0][:3] == [1, 0, 2] and len(turns[0]) == 3  # a call, its result, and a second call never run


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

    ag.write_demonstrations(str(tmp_path / "tools.jsonl"), 1, n=40)
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
