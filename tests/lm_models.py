"""Tiny random checkpoints of real architectures with tokenizers trained on the fly, and a stand-in LM:
the LM scripts' real-model path and log-prob alignment, tested offline."""
import torch

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
# Qwen2.5's tool format, written here: the tools' JSON schemas in a system turn, a call as <tool_call>{json}</tool_call>
# in the assistant's turn, a result as a user turn's <tool_response>
CHATML_TOOLS = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3.5's tool format, written here: a call as <tool_call><function=NAME><parameter=KEY>value</parameter>..., each
# argument as text (only the tool's schema types it); a turn's reasoning in <think>, which the generation prompt pre-writes
CHATML_TOOLS_XML = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m['content'] }}\n</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n"
    "{% if m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] or '' }}{% for c in m.get('tool_calls') or [] %}<tool_call>\n<function={{ c['function']['name'] }}>"
    "\n{% for k, v in c['function']['arguments'].items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}"
    "</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
TOKENIZER_KINDS = {
    # GPT-2: EOS, no pad, no BOS prepended, no chat template
    "eos_no_pad": dict(special=["<|endoftext|>"], bos="<|endoftext|>", eos="<|endoftext|>"),
    # Qwen2 base: pad == EOS, a ChatML template whose end of turn <|im_end|> is not EOS
    "pad_is_eos": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|endoftext|>",
                       pad="<|endoftext|>", chat_template=CHATML),
    # Qwen2.5 instruct: as pad_is_eos, with a template that renders tools, tool calls and tool results
    "tools": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|endoftext|>",
                  pad="<|endoftext|>", chat_template=CHATML_TOOLS),
    # Qwen3.5: EOS is <|im_end|>, the calls' arguments are written as text, the generation prompt opens <think>
    "tools_xml": dict(special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>",
                      pad="<|endoftext|>", chat_template=CHATML_TOOLS_XML),
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
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128)
    common |= {k: overrides.pop(k) for k in list(overrides) if k in common}
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


# ------------------------------------------------------------------------------------------------
# A stand-in LM for log-prob alignment tests
# ------------------------------------------------------------------------------------------------


class PositionLogits(torch.nn.Module):
    """A stand-in LM whose next-token distribution differs at every position (and row): logits[b, t, v] =
    3 sin(1 + 0.7 t + 1.3 v + b). Uniform logits cannot show a log-prob taken one position off; these do. They
    come out of a linear LM head, as head_logprobs needs: 3 sin(a + 1.3 v) = h · w_v with the hidden state
    h = 3 (sin a, cos a), a = 1 + 0.7 t + b, and the head's row w_v = (cos 1.3 v, sin 1.3 v)."""

    vocab = 11

    def __init__(self):
        from types import SimpleNamespace

        super().__init__()
        v = torch.arange(self.vocab).float()
        self.lm_head, self.config = torch.nn.Linear(2, self.vocab, bias=False), SimpleNamespace()
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.stack([torch.cos(1.3 * v), torch.sin(1.3 * v)], 1))

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=None):
        from types import SimpleNamespace

        b, t = (torch.arange(n).float() for n in input_ids.shape)
        a = 1 + 0.7 * t.view(1, -1) + b.view(-1, 1)
        hidden = 3 * torch.stack([torch.sin(a), torch.cos(a)], -1)
        return SimpleNamespace(logits=self.lm_head(hidden[:, -logits_to_keep:]))  # as transformers: the last k (0: all)


def by_hand(logits, sequences, positions):
    """log softmax of the logits at position p − 1, at the token at position p, for each (row, p)."""
    return torch.tensor([torch.log_softmax(logits[b, p - 1], -1)[sequences[b, p]].item() for b, p in positions])
