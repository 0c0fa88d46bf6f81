"""Test helpers: import the scripts from the repo root, run them as a user would, read their logs."""
import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_script(script, *flags, cwd, check=True, timeout=600):
    """`python <script> <flags>` in `cwd`, through the script's real entry point (tyro.cli -> main)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *flags], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{script} {' '.join(flags)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def only_run_dir(cwd):
    run_dirs = glob.glob(os.path.join(cwd, "runs", "*"))
    assert len(run_dirs) == 1, run_dirs
    return run_dirs[0]


def read_scalars(run_dir):
    """{tag: [(step, value), ...]} of every scalar in a TensorBoard run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_one_line_error(proc, *words):
    """Bad input: non-zero exit, a single line on stderr that names the problem, no traceback."""
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


TINY_LM = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2"]


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """A tiny SFT model and a reward model trained from it, made by the scripts themselves: {name: path}."""
    cwd = tmp_path_factory.mktemp("lm")
    run_script("sft.py", *TINY_LM, "--max-steps", "30", "--eval-every", "15", "--num-train-examples", "2000",
               "--eval-size", "32", "--output-dir", "models/sft", cwd=cwd)
    run_script("reward_model.py", "--max-steps", "20", "--eval-every", "10", "--num-train-pairs", "1000",
               "--eval-size", "32", cwd=cwd)
    return {"cwd": cwd, "sft": cwd / "models" / "sft", "reward_model": cwd / "models" / "reward_model"}


def run_in_process(script, *flags, cwd):
    """Run a script's real entry point, `main(tyro.cli(Args))`, in this process (no 4 s of imports per run)."""
    import importlib

    import tyro

    module = importlib.import_module(script[: -len(".py")])
    old = os.getcwd()
    os.chdir(cwd)
    try:
        module.main(tyro.cli(module.Args, args=list(flags)))
    finally:
        os.chdir(old)


# ------------------------------------------------------------------------------------------------
# Tiny random checkpoints of real architectures, with byte-level BPE tokenizers trained here: the
# real-model path of the LM scripts, offline. Four tokenizer kinds, each like a family of hub models.
# ------------------------------------------------------------------------------------------------
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2_CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
               "{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")
LLAMA3_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}"
               "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
TOKENIZER_KINDS = {
    # GPT-2: EOS, no pad, no BOS prepended, no chat template
    "eos_no_pad": dict(special=["<|endoftext|>"], bos="<|endoftext|>", eos="<|endoftext|>"),
    # Qwen2 base: pad == EOS, a ChatML template whose end of turn <|im_end|> is not EOS
    "pad_is_eos": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|endoftext|>",
                       pad="<|endoftext|>", chat_template=CHATML),
    # Llama 2 / Mistral: BOS prepended, no pad, a template that ends turns with EOS
    "bos": dict(special=["<s>", "</s>", "<unk>"], bos="<s>", eos="</s>", unk="<unk>", prepend_bos=True,
                chat_template=LLAMA2_CHAT),
    # Llama 3: BOS prepended, end of turn <|eot_id|> is not EOS, an unused pad token to reuse
    "chat_eot": dict(special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                              "<|eot_id|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_0|>"],
                     bos="<|begin_of_text|>", eos="<|end_of_text|>", prepend_bos=True, chat_template=LLAMA3_CHAT),
}
CORPUS = ["sort 4 1 3 2: 1 2 3 4", "Question: sort the digits 8 1 9 Answer: 1 8 9", "The cat sat on the mat.",
          "user assistant system hello world, what is the answer? It is 42.", "0123456789 sort digits"]


def make_tokenizer(kind):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = TOKENIZER_KINDS[kind]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 50, trainer)
    if spec.get("prepend_bos"):
        bos = spec["bos"]
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                               special_tokens=[(bos, backend.token_to_id(bos))])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **{f"{k}_token": spec[k] for k in ("bos", "eos", "pad", "unk")
                                                                     if k in spec})
    if "chat_template" in spec:
        tokenizer.chat_template = spec["chat_template"]
    return tokenizer


def make_model(arch, vocab_size, **overrides):
    """A tiny random causal LM of a real architecture (2 layers, 32 wide, 128 positions)."""
    from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig,
                              LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=2, **overrides))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=2, **overrides))
    if arch == "gpt_neox":
        return GPTNeoXForCausalLM(GPTNeoXConfig(**common, **overrides))
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=128, **overrides))


def save_checkpoint(path, arch, kind, dtype, padded_vocab=False, generation=None, **overrides):
    """Save a tiny random `arch` model with a `kind` tokenizer in `dtype` (as a hub checkpoint would be)."""
    import torch
    from transformers import GenerationConfig

    tokenizer = make_tokenizer(kind)
    vocab_size = -(-len(tokenizer) // 64) * 64 if padded_vocab else len(tokenizer)  # Qwen-style padded rows
    torch.manual_seed(0)
    model = make_model(arch, vocab_size, **overrides)
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    if generation:
        model.generation_config = GenerationConfig(**generation)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs a script or trains a model (CI runs them; `pytest -m 'not slow'` "
                                       "is the fast tier: the math and the copy checks, in seconds)")


def pytest_collection_modifyitems(items):
    """A test that runs a script needs a directory to run it in (or the tiny checkpoints, or monkeypatch
    to chdir): those are the slow tier."""
    for item in items:
        if {"tmp_path", "tiny_checkpoints", "monkeypatch"} & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)


# ------------------------------------------------------------------------------------------------
# Small environments whose right answers are known, for the RL scripts' wiring tests
# ------------------------------------------------------------------------------------------------
import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402


class CountingEnv(gym.Env):
    """Random rewards, random terminations, a time limit of 7 (registered below); it records the
    true return of every finished episode and counts every step it is asked to take."""

    finished_returns: list = []
    steps_taken = 0
    observation_space = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        if getattr(self, "episode_steps", 0) > 0:
            CountingEnv.finished_returns.append(self.episode_return)
        self.episode_return, self.episode_steps = 0.0, 0
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), {}

    def step(self, action):
        CountingEnv.steps_taken += 1
        reward = float(self.np_random.uniform(0, 1)) + float(action)
        self.episode_return += reward
        self.episode_steps += 1
        terminated = bool(self.np_random.uniform() < 0.15)
        return self.np_random.uniform(-1, 1, 3).astype(np.float32), reward, terminated, False, {}


class ClockEnv(gym.Env):
    """The observation is (t / 10, 0.5) at step t of the episode; reward 1 per step. Episodes of even
    number terminate after 2 steps; the others run until the time limit of 3 (registered below) cuts
    them. So a truncation's real final observation is (0.3, 0.5), while the reset one is (0, 0.5)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    actions_received: list = []

    def __init__(self, continuous=False, render_mode=None):
        self.action_space = gym.spaces.Box(-2.0, 2.0, (1,), np.float32) if continuous else gym.spaces.Discrete(2)
        self.episode = -1

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t, self.episode = 0, self.episode + 1
        return np.array([0.0, 0.5], dtype=np.float32), {}

    def step(self, action):
        ClockEnv.actions_received.append(action)
        self.t += 1
        terminated = self.episode % 2 == 0 and self.t == 2
        return np.array([self.t / 10, 0.5], dtype=np.float32), 1.0, terminated, False, {}


gym.register("CountingEnv-v0", entry_point=CountingEnv, max_episode_steps=7)
gym.register("Clock-v0", entry_point=ClockEnv, max_episode_steps=3)
gym.register("ClockBox-v0", entry_point=ClockEnv, kwargs={"continuous": True}, max_episode_steps=3)


def record_agents(module, monkeypatch):
    """Replace `module.Agent` by a subclass that remembers its instances; returns the list."""
    agents = []

    class RecordedAgent(module.Agent):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            agents.append(self)

    monkeypatch.setattr(module, "Agent", RecordedAgent)
    return agents


def first_gae_inputs(module, monkeypatch):
    """Wrap `module.compute_gae` to keep the inputs of its first call, together with the values the
    agent gives then to the observations (t/10, 0.5), t = 0..3; returns the dict it fills."""
    import torch

    agents, seen = record_agents(module, monkeypatch), {}
    real = module.compute_gae

    def spy(rewards, values, last_value, terminations, truncations, final_values, gamma, gae_lambda):
        if not seen:
            clock = torch.tensor([[t / 10, 0.5] for t in range(4)])
            with torch.no_grad():
                seen.update(rewards=rewards.copy(), terminations=terminations.copy(), truncations=truncations.copy(),
                            final_values=final_values.copy(), clock_values=agents[0].get_value(clock).numpy())
        return real(rewards, values, last_value, terminations, truncations, final_values, gamma, gae_lambda)

    monkeypatch.setattr(module, "compute_gae", spy)
    return seen


def same_seed_scalars(script, flags, tmp_path):
    """Run `script` twice with the same flags, in two directories; returns the logged scalars of each run
    (without the wall-clock ones: speeds and time fractions) and the bytes of every file each wrote
    under models/."""
    runs = []
    for name in ("a", "b"):
        cwd = tmp_path / name
        os.makedirs(cwd)
        run_script(script, *flags, cwd=cwd)
        scalars = read_scalars(only_run_dir(cwd))
        saved = {str(p.relative_to(cwd)): p.read_bytes() for p in sorted(cwd.glob("models/**/*.safetensors"))}
        runs.append(({tag: values for tag, values in scalars.items()
                      if not any(word in tag for word in ("SPS", "per_second", "time_fraction"))}, saved))
    return runs


# ------------------------------------------------------------------------------------------------
# A stand-in LM for log-prob alignment tests
# ------------------------------------------------------------------------------------------------
import torch  # noqa: E402


class PositionLogits(torch.nn.Module):
    """A stand-in LM whose next-token distribution differs at every position (and row): logits[b, t, v] =
    3 sin(1 + 0.7 t + 1.3 v + b). Uniform logits cannot show a log-prob taken one position off; these do."""

    vocab = 11

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        from types import SimpleNamespace

        b, t, v = (torch.arange(n).float() for n in (*input_ids.shape, self.vocab))
        return SimpleNamespace(logits=3 * torch.sin(1 + 0.7 * t.view(1, -1, 1) + 1.3 * v.view(1, 1, -1) + b.view(-1, 1, 1)))


def by_hand(logits, sequences, positions):
    """log softmax of the logits at position p − 1, at the token at position p, for each (row, p)."""
    return torch.tensor([torch.log_softmax(logits[b, p - 1], -1)[sequences[b, p]].item() for b, p in positions])
