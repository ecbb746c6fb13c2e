"""Character-level tokenizer for the tiny CPU model and its verifiable arithmetic task.

One token per printable ASCII character plus newline, one added token for ``\\boxed{`` (so the
answer marker costs the model one decision instead of seven), and three special tokens. The
result is a ``transformers.PreTrainedTokenizerFast`` whose ``save_pretrained`` output loads back
with ``transformers.AutoTokenizer.from_pretrained`` and round-trips any text drawn from its
alphabet exactly.

Id layout (stable: derived from fixed tables, never from set or dict iteration order):

    0..2    "<|pad|>", "<|endoftext|>", "<|unk|>"        (special)
    3       "\\n"
    4..98   " " .. "~"  (code points 32..126, in order)
    99      "\\boxed{"                                    (added, not special)
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
BOXED_TOKEN = "\\boxed{"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Concatenates every message's content and adds nothing for the generation prompt: the task's
# prompts are already complete ("37+45="), so a role header would only lengthen sequences.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def char_alphabet() -> list[str]:
    """The single-character tokens in id order: newline, then code points 32..126.

    Returns:
        list[str] of 96 one-character strings, sorted by code point.
    """
    return ["\n"] + [chr(code) for code in range(32, 127)]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Builds the character-level tokenizer (vocab size 100, see the module docstring for ids).

    Encoding adds no bos/eos (there is no post-processor); ``eos_token`` ("<|endoftext|>") is the
    stop token the rollout engine should use, ``pad_token`` ("<|pad|>") pads batches. Characters
    outside the alphabet (tab, carriage return, non-ASCII) encode to ``unk_token``, so only text
    drawn from the alphabet round-trips exactly.

    Returns:
        A ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers 5) with pad, eos and
        unk set, ``clean_up_tokenization_spaces=False`` and a minimal chat template.
    """
    vocab = {
        token: token_id for token_id, token in enumerate(SPECIAL_TOKENS + tuple(char_alphabet()))
    }
    # BPE without merges splits every input into single characters; no pre-tokenizer is needed
    # because spaces and newlines are ordinary tokens of the vocabulary.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    # Added tokens are matched before the model runs, so "\boxed{" becomes one token wherever it
    # appears; it is not special, so skip_special_tokens keeps it in decoded text.
    backend.add_tokens([AddedToken(BOXED_TOKEN, special=False, normalized=False)])
    # Without a decoder, `tokenizers` joins tokens with spaces ("8 2"); Fuse concatenates them.
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        # The default clean-up rewrites " ," to "," and " 's" to "'s", which breaks round trips.
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
