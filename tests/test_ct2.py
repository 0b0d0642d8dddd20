"""CTranslate2 as a bench mode: the converted model decodes what transformers' greedy decodes, including a Marian
model whose `<pad>` is id 0 and whose `<pad>` embedding is not zero (the recipes' layout, which the stock
converter refuses)."""

from __future__ import annotations

import torch
from conftest import build_model, word_tokenizer

from hf_blockwise.loading import LoadedModel
from hf_blockwise.tools import ct2
from hf_blockwise.tools.bench import BenchSetup, run_bench
from hf_blockwise.tools.bench.ct2_pass import ct2_unavailable


def sentences(count: int, seed: int) -> list[str]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (count,), generator=generator)
    return [" ".join(f"w{int(i)}" for i in torch.randint(3, 64, (int(n),), generator=generator)) for n in lengths]


def marian_with_pad_first():
    base = build_model("marian", seed=4)
    assert base.config.pad_token_id == 0 and base.config.vocab_size == 64  # `<pad>` first, not last
    with torch.no_grad():  # tied embeddings train the `<pad>` row too: it is not zero in the recipes' models
        base.get_input_embeddings().weight[0].normal_(std=0.35)
    base.generation_config.bad_words_ids = [[0]]  # as the recipes' models: `<pad>` is never generated
    return base


def test_converted_marian_decodes_what_transformers_greedy_decodes(tmp_path) -> None:
    base, tokenizer = marian_with_pad_first(), word_tokenizer()
    translator = ct2.load_translator(ct2.convert(base, tokenizer, str(tmp_path)), "float32", threads=1)
    run = ct2.greedy_runner(translator, tokenizer, base, limit=20)
    for batch_size in (1, 5):
        batch = dict(tokenizer(sentences(batch_size, seed=batch_size), return_tensors="pt", padding=True))
        expected = base.generate(**batch, max_new_tokens=20)
        decoded = run(batch, {})
        assert decoded.shape[0] == batch_size
        for got, want in zip(decoded, expected, strict=True):
            assert got[got != 0].tolist() == want[want != 0].tolist()
    assert base.get_input_embeddings().weight[0].abs().sum() > 0  # the model itself was not changed


def test_bench_times_ctranslate2_beside_transformers_greedy() -> None:
    base, tokenizer = marian_with_pad_first(), word_tokenizer()
    setup = BenchSetup(LoadedModel(base=base, tokenizer=tokenizer), max_new_tokens=16)
    results = run_bench(setup, sentences(6, seed=9), None, ["greedy", "ct2", "ct2_int8"], [1, 3], progress=False)
    by_row = {(result.mode, result.batch_size): result for result in results}
    assert set(by_row) == {(mode, size) for mode in ("greedy", "ct2", "ct2_int8") for size in (1, 3)}
    for size in (1, 3):
        exact = by_row[("ct2", size)]
        assert exact.compared == exact.identical == 6  # float32 CTranslate2 reproduces greedy here
        assert exact.speedup is not None and exact.seconds > 0
        int8 = by_row[("ct2_int8", size)]
        assert int8.compared == 6 and int8.sentences == 6  # int8 weights: compared, not required to be identical


def test_the_bench_names_why_it_skips_ctranslate2_on_an_architecture_it_does_not_convert(capsys) -> None:
    setup = BenchSetup(LoadedModel(base=build_model("bart", seed=1), tokenizer=word_tokenizer()), max_new_tokens=6)
    assert "not 'bart'" in ct2_unavailable(setup)
    results = run_bench(setup, sentences(2, seed=0), None, ["greedy", "ct2", "ct2_int8"], [1], progress=False)
    assert [result.mode for result in results] == ["greedy"]
    assert "skipping ct2: the bench converts ['marian'] models to CTranslate2, not 'bart'" in capsys.readouterr().out
