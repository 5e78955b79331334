"""Megatron's three SentencePiece tokenizer types over one SentencePiece model.

    SentencePieceTokenizer     eod = </s>, pad = <pad> or eod, no BOS added; --vocab-extra-ids
                               appends <extra_id_0> ... after the model's pieces (T5 sentinels)
    GPTSentencePieceTokenizer  eod = </s>, bos = <s>, pad = the model's pad id (-1 when it has
                               none), no BOS added (Megatron's _GPTSentencePieceTokenizer)
    Llama2Tokenizer            as GPTSentencePieceTokenizer, and every encoded text starts with
                               <s> (Megatron's _Llama2Tokenizer.tokenize(bos=True, eos=False))
"""

from array import array

from megalite.data.sentencepiece_tokenizer import SentencePieceTokenizer


class SentencePieceWithExtraIds(SentencePieceTokenizer):
    """SentencePieceTokenizer whose vocabulary ends in `vocab_extra_ids` sentinel tokens."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file)
        self.base_vocab_size = self.vocab_size
        self.extra_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        self.vocab_size += vocab_extra_ids

    def decode(self, ids) -> str:
        out, run = [], []
        for i in (int(i) for i in ids):
            if i >= self.base_vocab_size:
                out.append(super().decode(run))
                out.append(self.extra_tokens[i - self.base_vocab_size])
                run = []
            else:
                run.append(i)
        return "".join(out) + super().decode(run)


class GPTSentencePieceTokenizer(SentencePieceTokenizer):
    def __init__(self, model_file: str):
        super().__init__(model_file)
        self.pad = self.sp.pad_id()


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    def __init__(self, model_file: str):
        super().__init__(model_file)
        if self.bos < 0:
            raise ValueError(f"--tokenizer-model {model_file}: Llama2Tokenizer needs a <s> (bos) piece, "
                             "which this model lacks")
        self._bos_bytes = array("i", [self.bos]).tobytes()

    def encode_reference(self, text: str) -> list[int]:
        return [self.bos] + super().encode_reference(text)

    def encode_batch_bytes(self, texts: list[str]) -> list[bytes]:
        # encode() reads these bytes too, so both start with <s>.
        return [self._bos_bytes + ids for ids in super().encode_batch_bytes(texts)]
