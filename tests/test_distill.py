"""distill.py: the divergences against hand computations, the sampled-token estimator against the exact reverse KL,
and the script end to end (it learns, the teacher stays, every flag reaches the loss, real models and data, bad
input)."""
import json
import math
import random

import pytest
import torch
from conftest import (
    CPU_FLOAT32,
    assert_one_line_error,
    one_line_exit,
    only_run_dir,
    read_scalars,
    run_in_process,
    run_script,
    same_seed_scalars,
)
from lm_models import save_checkpoint

import distill

# Two next-token distributions over 3 tokens, with unequal probabilities; logits = log-probabilities
P_S, P_T = [0.5, 0.3, 0.2], [0.1, 0.3, 0.6]


def logits_of(p):
    return torch.tensor(p).log()


def kl(p, q):
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_generalized_jsd_by_hand_at_each_beta():
    # β = 0: KL(π_T ‖ π_S) = 0.1 ln(0.1/0.5) + 0.3 ln(0.3/0.3) + 0.6 ln(0.6/0.2) = −0.160944 + 0 + 0.659167 = 0.498223
    # β = 1: KL(π_S ‖ π_T) = 0.5 ln(0.5/0.1) + 0 + 0.2 ln(0.2/0.6) = 0.804719 − 0.219722 = 0.584997
    # β = 0.5: M = (0.3, 0.3, 0.4); KL(π_T ‖ M) = 0.1 ln(1/3) + 0.6 ln(1.5) = −0.109861 + 0.243279 = 0.133418,
    #   KL(π_S ‖ M) = 0.5 ln(5/3) + 0.2 ln(0.5) = 0.255413 − 0.138629 = 0.116783; JSD = ½ (0.133418 + 0.116783) = 0.125101
    # β = 0.25: M = 0.25 π_T + 0.75 π_S = (0.4, 0.3, 0.3); KL(π_T ‖ M) = 0.1 ln(0.25) + 0.6 ln 2 = 0.277259,
    #   KL(π_S ‖ M) = 0.5 ln(1.25) + 0.2 ln(2/3) = 0.030478; JSD = 0.25 · 0.277259 + 0.75 · 0.030478 = 0.092173
    for beta, expected in ((0.0, 0.498223), (1.0, 0.584997), (0.5, 0.125101), (0.25, 0.092173)):
        value = distill.generalized_jsd(logits_of(P_S), logits_of(P_T), beta)
        assert value.item() == pytest.approx(expected, abs=1e-5), beta


def test_the_ends_are_the_forward_and_reverse_kl_and_the_limits_of_the_jsd():
    torch.manual_seed(0)
    student, teacher = torch.randn(4, 5, 11), torch.randn(4, 5, 11)
    log_s, log_t = student.log_softmax(-1), teacher.log_softmax(-1)
    forward = (log_t.exp() * (log_t - log_s)).sum(-1)
    reverse = (log_s.exp() * (log_s - log_t)).sum(-1)
    torch.testing.assert_close(distill.generalized_jsd(student, teacher, 0.0), forward)
    torch.testing.assert_close(distill.generalized_jsd(student, teacher, 1.0), reverse)
    # GKD's JSD_β itself goes to 0 at the ends; divided by β (by 1 − β) it goes to the forward (the reverse) KL, so
    # β's direction is TRL's: near 0 the forward KL, near 1 the reverse
    eps = 1e-3  # (the forward and the reverse KL differ by 6% to 67% here)
    torch.testing.assert_close(distill.generalized_jsd(student, teacher, eps) / eps, forward, rtol=1e-2, atol=0)
    torch.testing.assert_close(distill.generalized_jsd(student, teacher, 1 - eps) / eps, reverse, rtol=1e-2, atol=0)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_the_divergence_is_zero_with_no_gradient_when_the_distributions_are_equal(beta):
    torch.manual_seed(1)
    logits = torch.randn(3, 7, requires_grad=True)
    value = distill.generalized_jsd(logits, logits.detach().clone() + 5.0, beta)  # a shift leaves softmax unchanged
    torch.testing.assert_close(value, torch.zeros(3), atol=1e-6, rtol=0)
    value.sum().backward()
    torch.testing.assert_close(logits.grad, torch.zeros(3, 7), atol=1e-6, rtol=0)


def test_temperature_divides_both_models_logits_and_only_the_student_gets_a_gradient():
    torch.manual_seed(2)
    student, teacher = torch.randn(2, 9, requires_grad=True), torch.randn(2, 9, requires_grad=True)
    torch.testing.assert_close(distill.generalized_jsd(student, teacher, 0.3, temperature=2.5),
                               distill.generalized_jsd(student / 2.5, teacher / 2.5, 0.3))
    distill.generalized_jsd(student, teacher, 0.3).sum().backward()
    assert student.grad.abs().sum() > 0 and teacher.grad is None


def test_the_sampled_token_estimate_and_its_gradient_are_the_reverse_kls_on_average():
    torch.manual_seed(3)
    student = torch.tensor([1.0, -0.5, 0.2, 2.0], requires_grad=True)
    teacher = torch.tensor([0.3, 0.9, -1.2, 1.5])
    exact = distill.generalized_jsd(student, teacher, 1.0)
    exact_grad, = torch.autograd.grad(exact, student)
    n = 400_000
    tokens = torch.multinomial(student.softmax(-1).detach(), n, replacement=True)
    logprobs = student.log_softmax(-1)[tokens]
    teacher_logprobs = teacher.log_softmax(-1)[tokens]
    k = (logprobs - teacher_logprobs).detach()
    assert abs(k.mean().item() - exact.item()) < 4 * k.std().item() / math.sqrt(n)  # E[k] = KL(π_S ‖ π_T)
    loss = distill.sampled_token_loss(logprobs, teacher_logprobs).mean()
    grad, = torch.autograd.grad(loss, student)
    torch.testing.assert_close(grad, exact_grad, atol=0.01, rtol=0)  # E[∇L] = ∇ KL(π_S ‖ π_T)
    # and by hand, one token: k = ln π_S(x) − ln π_T(x), the loss k · ln π_S(x), its value k · ln π_S(x)
    lp, tlp = torch.tensor([-0.7]), torch.tensor([-1.9])
    assert distill.sampled_token_loss(lp, tlp).item() == pytest.approx((-0.7 + 1.9) * -0.7)


def test_masked_mean_weighs_every_completion_token_the_same():
    values = torch.tensor([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert distill.masked_mean(values, mask).item() == pytest.approx((1 + 2 + 4) / 3)


@pytest.fixture(scope="module")
def models(tiny_checkpoints, small_checkpoints):
    """A student (the 30-step tiny SFT model) and a teacher (the 300-step small one): one tokenizer, other weights."""
    return {"student": str(tiny_checkpoints["sft"]), "teacher": str(small_checkpoints["sft"])}


def distill_flags(models, *flags):
    return ["--model-name-or-path", models["student"], "--teacher-model-name-or-path", models["teacher"],
            "--batch-size", "16", "--eval-size", "32", *CPU_FLOAT32, *flags]


@pytest.mark.parametrize("flags", [[], ["--beta", "0.5"], ["--beta", "0"], ["--sampled-token"]])
def test_one_step_on_a_fixed_batch_lowers_the_divergence(models, flags):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(models["student"])
    student = AutoModelForCausalLM.from_pretrained(models["student"])
    teacher = AutoModelForCausalLM.from_pretrained(models["teacher"]).requires_grad_(False)
    prompts = [distill.encode_prompt(tokenizer, distill.make_prompt(random.Random(i))[0]) for i in range(256)]
    sequences, attention_mask, width, mask, _ = distill.generate(student, prompts, tokenizer.pad_token_id,
                                                                  distill.stop_token_ids(tokenizer), 12)
    mask = mask.float()
    vocab = student.config.vocab_size
    teacher_logits = distill.completion_logits(teacher, sequences, attention_mask, width, vocab)
    beta = 1.0 if "--sampled-token" in flags else float(flags[1]) if flags else 1.0

    def divergence():
        logits = distill.completion_logits(student, sequences, attention_mask, width, vocab)
        return logits, distill.masked_mean(distill.generalized_jsd(logits, teacher_logits, beta), mask)

    logits, before = divergence()
    if "--sampled-token" in flags:
        tokens = sequences[:, width:, None]
        loss = distill.masked_mean(distill.sampled_token_loss(logits.log_softmax(-1).gather(-1, tokens).squeeze(-1),
                                                              teacher_logits.log_softmax(-1).gather(-1, tokens).squeeze(-1)),
                                   mask)
    else:
        loss = before
    loss.backward()
    torch.optim.Adam(student.parameters(), lr=1e-3).step()  # each weight moves by about lr, against its gradient
    _, after = divergence()
    assert after < 0.995 * before, (before.item(), after.item())  # by 1% to 8% here; a flipped sign raises it


def test_training_changes_the_student_and_never_the_teacher(models, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    loaded = []
    real = distill.load_models

    def loading(*args):
        out = real(*args)
        loaded.append(out)
        return out

    monkeypatch.setattr(distill, "load_models", loading)
    run_in_process("distill.py", *distill_flags(models, "--num-iterations", "4", "--lr", "1e-2"), cwd=tmp_path)
    _, _, student, teacher, _ = loaded[0]
    assert not any(p.requires_grad for p in teacher.parameters()) and not teacher.training
    on_disk = load_file(f"{models['teacher']}/model.safetensors")
    for name, tensor in teacher.state_dict().items():
        if name in on_disk:
            assert torch.equal(tensor, on_disk[name]), name  # bitwise the checkpoint's
    start = load_file(f"{models['student']}/model.safetensors")
    trained = load_file(tmp_path / "models" / "distill" / "model.safetensors")
    assert any(not torch.equal(trained[name], start[name]) for name in start)


@pytest.mark.parametrize("flags", [[], ["--beta", "0.5"], ["--sampled-token"], ["--beta", "0", "--lmbda", "0.5"]])
def test_distillation_moves_the_student_to_the_teacher(models, flags, tmp_path):
    """A short run from the 300-step SFT model toward the 30-step one, whose completions are far from it (a reverse
    KL of 3.7 nats per token): the student's reverse KL on held-out prompts falls by more than 80%, and its gold
    score falls to the teacher's, which distillation copies whatever it is worth. A flipped sign fails both."""
    run_in_process("distill.py", *distill_flags({"student": models["teacher"], "teacher": models["student"]},
                                                "--num-iterations", "100", "--eval-every", "100", "--lr", "1e-2",
                                                "--batch-size", "32", "--eval-size", "64", *flags), cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    kl, score = ([v for _, v in scalars[tag]] for tag in ("eval/reverse_kl", "eval/gold_score"))
    assert kl[-1] < 0.2 * kl[0], kl
    teacher = scalars["eval/teacher_gold_score"][0][1]
    assert abs(score[-1] - teacher) < 0.5 * abs(score[0] - teacher), (score, teacher)
    assert [s for s, _ in scalars["losses/loss"]] == list(range(1, 101))


def test_distillation_toward_a_better_teacher_raises_the_gold_score(models, tmp_path):
    """And from the 30-step model toward the 300-step one, the gold score rises (0.01 to 0.12 here)."""
    run_in_process("distill.py", *distill_flags(models, "--num-iterations", "100", "--eval-every", "100", "--lr", "1e-2",
                                                "--batch-size", "32", "--eval-size", "64"), cwd=tmp_path)
    score = [v for _, v in read_scalars(only_run_dir(tmp_path))["eval/gold_score"]]
    assert score[-1] > score[0] + 0.06, score


def spy(monkeypatch, name):
    """Record the arguments and result of each call of distill.<name>."""
    calls, real = [], getattr(distill, name)

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    monkeypatch.setattr(distill, name, recording)
    return calls


@pytest.mark.parametrize("flags, beta, temperature", [([], 1.0, 1.0), (["--beta", "0.3"], 0.3, 1.0),
                                                       (["--beta", "0", "--temperature", "0.7"], 0.0, 0.7),
                                                       (["--sampled-token", "--temperature", "1.3"], None, 1.3)])
def test_every_flag_reaches_the_loss(models, flags, beta, temperature, tmp_path, monkeypatch):
    """The logged loss of each step is the one computed here from the logits the step saw, with the flags' β and
    temperature: the generalized JSD, or the sampled-token loss on the drawn tokens; the sampler draws at the
    temperature too."""
    logits = spy(monkeypatch, "completion_logits")
    sampled = spy(monkeypatch, "generate")
    run_in_process("distill.py", *distill_flags(models, "--num-iterations", "2", "--eval-size", "0", *flags), cwd=tmp_path)
    losses = read_scalars(only_run_dir(tmp_path))["losses/loss"]
    assert len(logits) == 4 and all(call[0][5] == temperature for call in sampled)
    for step in range(2):
        (teacher_args, _, teacher), (_, _, student) = logits[2 * step], logits[2 * step + 1]
        sequences, width, mask = teacher_args[1], teacher_args[3], sampled[step][2][3].float()
        log_s, log_t = (z.double().div(temperature).log_softmax(-1) for z in (student, teacher))
        if beta is None:  # by hand: k · log π_S(x) at each drawn token, k = log π_S(x) − log π_T(x)
            tokens = sequences[:, width:, None]
            lp, tlp = log_s.gather(-1, tokens).squeeze(-1), log_t.gather(-1, tokens).squeeze(-1)
            per_token = (lp - tlp) * lp
        else:
            m = (beta * log_t.exp() + (1 - beta) * log_s.exp()).log()
            per_token = (beta * (log_t.exp() * (log_t - m)).sum(-1) + (1 - beta) * (log_s.exp() * (log_s - m)).sum(-1)
                         if 0 < beta < 1 else (log_t.exp() * (log_t - log_s)).sum(-1) if beta == 0
                         else (log_s.exp() * (log_s - log_t)).sum(-1))
        expected = (per_token * mask).sum() / mask.sum()
        assert losses[step][1] == pytest.approx(expected.item(), rel=1e-4, abs=1e-6), (flags, step)


def test_lmbda_picks_whose_completions_each_batch_trains_on(models, tmp_path, monkeypatch):
    """--lmbda 0: every batch is the dataset's completions (the built-in task's: the targets, then the stop token);
    --lmbda 0.5: about half the batches are the student's own."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["student"])
    logits = spy(monkeypatch, "completion_logits")
    sampled = spy(monkeypatch, "generate")
    run_in_process("distill.py", *distill_flags(models, "--num-iterations", "2", "--eval-size", "0", "--lmbda", "0"),
                   cwd=tmp_path)
    assert not sampled
    args = logits[0][0]
    completions = tokenizer.batch_decode(args[1][:, args[3]:], skip_special_tokens=True)
    assert all(c.isdigit() and list(c) == sorted(c) for c in completions), completions
    assert (args[1][:, args[3]:] == tokenizer.eos_token_id).sum(1).tolist() == [1] * len(completions)
    sampled.clear()
    run_in_process("distill.py", *distill_flags(models, "--num-iterations", "30", "--eval-size", "0", "--lmbda", "0.5",
                                                "--exp-name", "half"), cwd=tmp_path)
    assert 7 <= len(sampled) <= 23, len(sampled)


def test_real_architectures_with_a_conversational_dataset_and_vocabularies_padded_differently(tmp_path):
    """A Qwen2-shaped student with its vocabulary padded to a multiple of 64 and a Llama-shaped teacher with the same
    tokenizer unpadded, on a prompt-only conversational dataset through the chat template, and prompt-completion rows
    for --lmbda below 1: it trains, and its reverse KL is logged."""
    student = save_checkpoint(str(tmp_path / "student"), "qwen2", "pad_is_eos", "bfloat16", padded_vocab=True)
    teacher = save_checkpoint(str(tmp_path / "teacher"), "llama", "pad_is_eos", "float32")
    rows = [{"prompt": [{"role": "user", "content": f"count to {i % 7}"}],
             "completion": [{"role": "assistant", "content": " ".join(map(str, range(i % 7)))}]} for i in range(40)]
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    run_in_process("distill.py", "--model-name-or-path", student, "--teacher-model-name-or-path", teacher,
                   "--dataset-name", str(data), "--num-iterations", "3", "--batch-size", "8", "--eval-size", "8",
                   "--lmbda", "0.5", "--beta", "0.5", *CPU_FLOAT32, cwd=tmp_path)
    scalars = read_scalars(only_run_dir(tmp_path))
    assert len(scalars["losses/loss"]) == 3 and "eval/reverse_kl" in scalars and "eval/gold_accuracy" not in scalars


def test_bad_input_is_one_line_before_any_work(models, tmp_path):
    other = save_checkpoint(str(tmp_path / "other"), "llama", "bos", "float32")
    assert "another tokenizer" in one_line_exit("distill.py", *distill_flags(models, "--teacher-model-name-or-path",
                                                                             other), cwd=tmp_path)
    for flags, words in ((["--beta", "1.5"], "--beta 1.5"), (["--lmbda", "nan"], "--lmbda nan"),
                         (["--sampled-token", "--beta", "0.5"], "--sampled-token"),
                         (["--sampled-token", "--lmbda", "0.5"], "--lmbda 1"), (["--temperature", "0"], "--temperature"),
                         (["--batch-size", "0"], "--batch-size")):
        assert words in one_line_exit("distill.py", *distill_flags(models, *flags), cwd=tmp_path), flags
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"sort {i}:"}) for i in range(40)))
    assert "completion" in one_line_exit("distill.py", *distill_flags(models, "--dataset-name", str(data), "--lmbda",
                                                                      "0.5"), cwd=tmp_path)
    assert not (tmp_path / "models").exists() and not (tmp_path / "runs").exists()
    # as a user runs it: the line alone on stderr
    assert_one_line_error(run_script("distill.py", "--teacher-model-name-or-path", str(tmp_path / "missing"),
                                     "--model-name-or-path", models["student"], cwd=tmp_path, check=False),
                          "missing", "does not exist")


def test_the_same_seed_gives_the_same_run(models, tmp_path):
    """Two runs of one seed, with batches of the dataset's and of the student's: the same scalars and the same
    weights."""
    (first, first_saved), (second, second_saved) = same_seed_scalars(
        "distill.py", distill_flags(models, "--num-iterations", "4", "--eval-every", "2", "--lmbda", "0.5", "--beta",
                                    "0.5"), tmp_path)
    assert first == second and first_saved == second_saved and len(first["losses/loss"]) == 4


# ------------------------------------------------------------------------ self-distillation (OPSD, SDFT, SDPO)
def test_success_demonstrations_are_another_success_of_the_same_group():
    # G = 4. Group 1 passes at 1 and 2: 0 and 3 are taught by 1 (the first), 1 by 2, 2 by 1 (never by itself).
    # Group 2 passes at 6 alone: 4, 5 and 7 are taught by 6; 6 has no other success: −1 (no loss)
    passed = [False, True, True, False, False, False, True, False]
    assert distill.success_demonstrations(passed, 4) == [1, 2, 1, 1, 6, 6, -1, 6]
    assert distill.success_demonstrations([False, False, True, True], 2) == [-1, -1, 3, 2]


def test_ema_update_moves_the_teacher_by_tau():
    # θ_T = 1, θ_S = 3: τ = 0.25 → 0.75 · 1 + 0.25 · 3 = 1.5; τ = 0 → 1; τ = 1 → 3
    for rate, expected in ((0.25, 1.5), (0.0, 1.0), (1.0, 3.0)):
        teacher, student = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False)
        teacher.weight.data.fill_(1.0), student.weight.data.fill_(3.0)
        distill.ema_update(teacher, student, rate)
        assert teacher.weight.item() == pytest.approx(expected) and student.weight.item() == 3.0


def test_the_teacher_prompt_wraps_the_prompt_and_its_context():
    template = "{prompt}\n\n{privileged_context}"
    assert distill.teacher_prompt("sort 312:", "123", template) == "sort 312:\n\n123"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 312:"}]
    assert distill.teacher_prompt(chat, "123", template) == [chat[0], {"role": "user", "content": "sort 312:\n\n123"}]
    assert distill.reference_answer({"prompt": "p", "target": "123"}) == "123"
    assert distill.reference_answer({"prompt": chat, "completion": [{"role": "assistant", "content": "9"}]}) == "9"


@pytest.mark.parametrize("context", ["answer", "success"])
def test_self_distillation_the_teacher_reads_the_context_and_the_student_does_not(models, context, tmp_path,
                                                                                   monkeypatch):
    """--self-distill: the teacher is the student's starting checkpoint (bitwise), and of each batch's forward passes
    the student's reads the prompt alone, the teacher's the prompt with its privileged context (the target, or with
    `success` a sibling's completion that is exactly the target) and then the same completion tokens; `success`
    keeps the loss of exactly the completions that have such a sibling (the batch's completions 1, 2 and 6 are made
    the target: group 1 has two successes, group 2 one, which no sibling teaches). --teacher-update-rate reaches
    ema_update."""
    from safetensors.torch import load_file

    calls, loaded, rates, kept, masks = [], [], [], [], []
    real = {name: getattr(distill, name) for name in ("completion_logits", "load_models", "ema_update", "teacher_view",
                                                      "generate", "masked_mean")}

    def generate_spy(model, prompt_ids, pad_token_id, *rest, **kwargs):
        sequences, attention_mask, width, mask, _ = real["generate"](model, prompt_ids, pad_token_id, *rest, **kwargs)
        tokenizer = loaded[0][0]
        completions = [sequences[i, width:][mask[i].bool()].tolist() for i in range(len(prompt_ids))]
        for i in (1, 2, 6):
            prompt = tokenizer.decode(prompt_ids[i], skip_special_tokens=True).strip()
            completions[i] = tokenizer("".join(sorted(prompt[len("sort ") : -1])),
                                       add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return (*distill.pad_completions(prompt_ids, completions, pad_token_id, sequences.device), None)

    def logits_spy(model, sequences, attention_mask, context_length, vocab):
        calls.append((model, sequences.clone(), attention_mask.clone(), context_length))
        return real["completion_logits"](model, sequences, attention_mask, context_length, vocab)

    def load_spy(*args):
        loaded.append(real["load_models"](*args))
        return loaded[-1]

    def ema_spy(teacher, student, rate):
        rates.append(rate)
        return real["ema_update"](teacher, student, rate)

    def view_spy(*args):
        seen, mask = real["teacher_view"](*args)
        kept.append((mask.sum(1, keepdim=True) > 0).float())  # a completion always has a token: kept or not
        return seen, mask

    def mean_spy(x, mask, num_tokens=None):
        masks.append(mask.clone())
        return real["masked_mean"](x, mask, num_tokens)

    for name, spy in (("completion_logits", logits_spy), ("load_models", load_spy), ("ema_update", ema_spy),
                      ("teacher_view", view_spy), ("generate", generate_spy), ("masked_mean", mean_spy)):
        monkeypatch.setattr(distill, name, spy)
    sft = models["student"]
    flags = ["--model-name-or-path", sft, "--teacher-model-name-or-path", str(tmp_path / "never-read"),
             "--self-distill", "--teacher-context", context, "--num-generations", "4", "--batch-size", "16",
             "--num-iterations", "1", "--eval-size", "0", "--teacher-update-rate", "0.5", "--seed", "3", *CPU_FLOAT32]
    run_in_process("distill.py", *flags, cwd=tmp_path)
    tokenizer, _, student, teacher, _ = loaded[0]
    ((_, s_seq, _, s_width), (_, t_seq, t_mask, t_width)) = [(m, *rest) for m, *rest in calls if m is student][:1] + \
        [(m, *rest) for m, *rest in calls if m is teacher][:1]
    assert torch.equal(s_seq[:, s_width:], t_seq[:, t_width:])  # the same completion tokens
    prompts = tokenizer.batch_decode(s_seq[:, :s_width], skip_special_tokens=True)
    teacher_prompts = tokenizer.batch_decode(t_seq[:, :t_width], skip_special_tokens=True)
    completions = tokenizer.batch_decode(s_seq[:, s_width:], skip_special_tokens=True)
    targets = ["".join(sorted(p.strip()[len("sort ") : -1])) for p in prompts]
    assert all(p.strip().startswith("sort ") and "\n" not in p.strip() for p in prompts)  # the student: no context
    (keep,) = kept
    for i, (p, t) in enumerate(zip(prompts, teacher_prompts)):
        head, _, given = t.partition("\n\n")
        assert head == p.strip()
        if context == "answer":
            assert given == targets[i]
        elif keep[i].item():  # a sibling's completion, exactly the target
            assert given == targets[i] and any(completions[j] == targets[i] for j in range(i - i % 4, i - i % 4 + 4)
                                                 if j != i)
    if context == "success":
        expected = [float(sum(completions[j] == targets[i] for j in range(i - i % 4, i - i % 4 + 4) if j != i) > 0)
                    for i in range(16)]
        assert keep.squeeze(1).tolist() == expected and expected[:8] == [1, 1, 1, 1, 1, 1, 0, 1]
        assert sum(expected) < 16, (completions, targets)
        assert masks[0].sum(1).tolist() == [n * k for n, k in zip((t_mask[:, t_width:].sum(1)).tolist(), expected)]
    on_disk = load_file(f"{sft}/model.safetensors")
    assert rates == [0.5] and any(not torch.equal(tensor, on_disk[name]) for name, tensor in teacher.state_dict().items()
                                  if name in on_disk)  # the EMA moved it from the start
    assert not any(p.requires_grad for p in teacher.parameters())


def test_self_distillation_bad_input_is_one_line(models, tmp_path):
    for flags, words in ((["--self-distill", "--teacher-context", "hint"], "--teacher-context 'hint'"),
                         (["--teacher-update-rate", "0.1"], "only under --self-distill"),
                         (["--self-distill", "--teacher-update-rate", "1.5"], "--teacher-update-rate 1.5"),
                         (["--self-distill", "--teacher-context", "success"], "--num-generations 2 or more"),
                         (["--num-generations", "3"], "groups of --num-generations 3"),
                         (["--teacher-context", "success"], "under --self-distill only"),
                         (["--teacher-prompt-template", "{prompt} {privileged_context}!"], "under --self-distill only"),
                         (["--self-distill", "--teacher-prompt-template", "{prompt} {answer}"], "{privileged_context}")):
        assert words in one_line_exit("distill.py", *distill_flags(models, *flags), cwd=tmp_path), flags
    assert not (tmp_path / "models").exists() and not (tmp_path / "runs").exists()
