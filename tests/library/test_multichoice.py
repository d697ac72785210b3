import random

import pytest
import torch

from logitless.hf import final_hidden_states, lm_head_of
from logitless.models import tiny_qwen2
from logitless.multichoice.data import format_question, synthetic_multichoice
from logitless.ops.head import LinearHead
from logitless.ops.lazy import CompletionLogits
from logitless.multichoice.answer import extract_answer_probability_from_logits, find_answer_position
from logitless.multichoice.judge import MultichoiceJudge
from logitless.multichoice.letters import choice_token_ids
from logitless.multichoice.recompute import answer_probability_by_recomputing
from logitless.multichoice.reward import multichoice_judge_reward
from logitless.multichoice.strip import strip_final_answer

QWEN_LETTER_IDS = {"A": [32, 362], "B": [33, 425], "C": [34, 356], "D": [35, 422]}  # bare, spaced


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def letter_probability(row, letter, renormalize):
    """Direct reference: softmax of the whole row, summed over the letter's two token ids."""
    probs = torch.softmax(row.double(), dim=-1)
    mass = {name: float(probs[ids].sum()) for name, ids in QWEN_LETTER_IDS.items()}
    return mass[letter] / sum(mass.values()) if renormalize else mass[letter]


def test_choice_token_ids_with_the_real_qwen_tokenizer(tokenizer):
    assert choice_token_ids(tokenizer) == QWEN_LETTER_IDS
    assert [tokenizer.decode([i]) for i in choice_token_ids(tokenizer, "C")["C"]] == ["C", " C"]
    assert choice_token_ids(tokenizer, "AE") == {"A": [32, 362], "E": [36, 468]}


def test_letters_that_are_not_one_token_are_refused(tokenizer):
    with pytest.raises(ValueError, match="choices: letter 'Ω' is not a single token in the form ' Ω'"):
        choice_token_ids(tokenizer, "AΩ")  # 'Ω' is one token, ' Ω' is two
    with pytest.raises(ValueError, match="choices: letter 'ꙮ'"):
        choice_token_ids(tokenizer, "ꙮ")
    with pytest.raises(ValueError, match="choices: letters must be distinct"):
        choice_token_ids(tokenizer, "ABA")
    with pytest.raises(ValueError, match="choices: expected at least one"):
        choice_token_ids(tokenizer, "")
    with pytest.raises(TypeError, match="choices"):
        choice_token_ids(tokenizer, ["A", "B"])


def test_answer_position_after_the_last_marker(tokenizer):
    ids = encode(tokenizer, "A is tempting, but no. answer: A? Let me redo it. ANSWER: C")
    assert ids[-1] == 356 and find_answer_position(ids, tokenizer) == len(ids) - 1
    # the first letter after the marker, even with words (no letter tokens) in between
    ids = encode(tokenizer, "Checked. Answer: it is D, not B")
    assert tokenizer.decode([ids[find_answer_position(ids, tokenizer)]]) == " D"
    ids = encode(tokenizer, "Final pick = B then D")
    assert tokenizer.decode([ids[find_answer_position(ids, tokenizer, marker="final pick =")]]) == " B"
    assert find_answer_position(torch.tensor(ids), tokenizer, marker="pick") == find_answer_position(
        ids, tokenizer, marker="pick")


def test_answer_position_falls_back_to_the_last_letter_then_none(tokenizer):
    ids = encode(tokenizer, "Between B and C, I pick C because it is bigger.")
    position = find_answer_position(ids, tokenizer)
    assert tokenizer.decode([ids[position]]) == " C" and tokenizer.decode(ids[position + 1:]).startswith(" because")
    # a marker with no letter token after it: a letter before the marker is not the answer (its row predicted a
    # word of the reasoning), so there is no answer position and the reward is 0
    assert find_answer_position(encode(tokenizer, "Maybe A. ANSWER: none of them"), tokenizer) is None
    assert find_answer_position(encode(tokenizer, "Option A is wrong. ANSWER:B"), tokenizer) is None  # ':B', one token
    assert find_answer_position(encode(tokenizer, "no letter in here"), tokenizer) is None
    assert find_answer_position([], tokenizer) is None
    with pytest.raises(TypeError, match="completion_ids"):
        find_answer_position("ANSWER: A", tokenizer)


def test_probability_equals_a_direct_softmax_of_the_answer_row(tokenizer):
    ids = encode(tokenizer, "Let me think. ANSWER: B")
    vocab = 1000
    logits = torch.randn(len(ids), vocab) * 3  # (C, V)
    logits[:, [32, 362, 33, 425, 34, 356, 35, 422]] += 4.0  # make the letters matter
    row = logits[len(ids) - 1]
    for letter in "ABCD":
        for renormalize in (True, False):
            got = extract_answer_probability_from_logits(logits, ids, tokenizer, letter, renormalize=renormalize)
            assert got == pytest.approx(letter_probability(row, letter, renormalize), rel=1e-5)
    total = sum(extract_answer_probability_from_logits(logits, ids, tokenizer, letter) for letter in "ABCD")
    assert total == pytest.approx(1.0, abs=1e-6)


def test_probability_from_a_completion_logits_view_reads_one_row(tokenizer):
    ids = encode(tokenizer, "The largest is 7, option D.\nANSWER: D")
    hidden, weight, bias = torch.randn(len(ids), 16), torch.randn(500, 16), torch.randn(500)
    view = CompletionLogits(hidden, LinearHead(weight, bias=bias, temperature=0.7))
    rows = (hidden @ weight.T + bias) / 0.7  # (C, V), the reference only

    class Recording:
        def __init__(self):
            self.read = []

        def __getitem__(self, t):
            self.read.append(t)
            return view[t]

    recording = Recording()
    got = extract_answer_probability_from_logits(recording, ids, tokenizer, "D", renormalize=False)
    assert recording.read == [len(ids) - 1]
    assert got == pytest.approx(letter_probability(rows[-1], "D", False), rel=1e-5)
    renormalized = extract_answer_probability_from_logits(view, ids, tokenizer, "A")
    assert renormalized == pytest.approx(letter_probability(rows[-1], "A", True), rel=1e-5)


def test_probability_edge_cases_and_bad_input(tokenizer):
    ids = encode(tokenizer, "nothing to see")
    assert extract_answer_probability_from_logits(torch.randn(len(ids), 500), ids, tokenizer, "A") == 0.0
    ids = encode(tokenizer, "ANSWER: A")
    logits = torch.randn(len(ids), 500)
    with pytest.raises(ValueError, match="correct_answer"):
        extract_answer_probability_from_logits(logits, ids, tokenizer, "E")
    with pytest.raises(ValueError, match="completion_logits: has 2 rows"):
        extract_answer_probability_from_logits(logits[:2], ids, tokenizer, "A")
    with pytest.raises(TypeError, match="completion_ids"):
        extract_answer_probability_from_logits(logits, torch.tensor(ids, dtype=torch.float32), tokenizer, "A")
    with pytest.raises(ValueError, match="completion_logits: rows have 100 entries"):
        extract_answer_probability_from_logits(torch.randn(len(ids), 100), ids, tokenizer, "A")
    # -inf marks a token that can never be sampled (a -inf bias): allowed, and exactly 0 probability
    expected = extract_answer_probability_from_logits(logits, ids, tokenizer, "A")
    masked = logits.clone()
    masked[:, 0] = float("-inf")  # "!" is no letter
    assert extract_answer_probability_from_logits(masked, ids, tokenizer, "A") == pytest.approx(expected)
    masked[:, choice_token_ids(tokenizer)["A"]] = float("-inf")
    assert extract_answer_probability_from_logits(masked, ids, tokenizer, "A") == 0.0
    logits[-1, 0] = float("nan")
    with pytest.raises(ValueError, match="completion_logits: contains NaN"):
        extract_answer_probability_from_logits(logits, ids, tokenizer, "A")


def test_strip_final_answer_of_a_degenerate_generation():
    """A long run of separators (common in RL rollouts) once made the search quadratic: 20,000 periods took 48 s."""
    text = "Thinking" + "." * 20_000 + " so the answer is (B)."
    assert strip_final_answer(text) == "Thinking"
    assert strip_final_answer("x" + " " * 20_000 + "y") == "x" + " " * 20_000 + "y"


def test_strip_final_answer():
    assert strip_final_answer("7 is the largest.\nANSWER: B") == "7 is the largest."
    # the answer stated just before the marker would give it away as well
    assert strip_final_answer("17 is largest, so the answer is B.\nANSWER: B") == "17 is largest"
    assert strip_final_answer("answer: A? no. Then answer: C.", marker="answer:") == "answer: A? no. Then"
    assert strip_final_answer("7 beats 3, so the answer is (B).") == "7 beats 3"
    assert strip_final_answer("It must be 12.\nAnswer: D") == "It must be 12."
    assert strip_final_answer("Thus the correct answer is **C**") == ""
    assert strip_final_answer("The answer is 1, option 2.", choices="12") == "The answer is 1, option 2."
    for untouched in ("12 is bigger than 9, B is wrong. ", "The answer is Bob.", "answer is B because 7 > 3"):
        assert strip_final_answer(untouched) == untouched
    with pytest.raises(TypeError, match="text"):
        strip_final_answer(None)


@pytest.fixture(scope="module")
def judge_questions():
    records = synthetic_multichoice(5, seed=3)
    questions = [format_question(r["question"], r["choices"]) for r in records]
    chains = ["Short.", "A much longer chain of thought that goes on and on about the options before deciding. "
              "So the answer is B.", "Medium length reasoning here.\nANSWER: C", "", "Compare 3 and 9; 9 wins."]
    return questions, chains, [r["answer"] for r in records]


def test_judge_matches_a_materialized_forward_of_each_prompt(tokenizer, tiny_model, judge_questions):
    questions, chains, answers = judge_questions
    judge = MultichoiceJudge(tiny_model, tokenizer, batch_size=4)
    got = judge.probabilities(questions, chains, answers)
    for question, chain, answer, p in zip(questions, chains, answers, got):
        prompt = judge.prompt(question, chain)
        assert prompt.endswith("\nANSWER:") and "So the answer is" not in prompt
        with torch.no_grad():
            row = tiny_model(input_ids=torch.tensor([tokenizer(prompt)["input_ids"]])).logits[0, -1]
        assert p == pytest.approx(letter_probability(row, answer, True), rel=1e-4)


def tiny_gpt2():
    """Absolute position embeddings: left padding is only right if each prompt's positions start at 0."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=151936, n_embd=32, n_layer=1, n_head=2, n_positions=256))


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_judge_batches_left_padded_and_renormalizes(tokenizer, tiny_model, judge_questions, kind):
    questions, chains, answers = judge_questions
    model = tiny_model if kind == "qwen2" else tiny_gpt2()
    model.train()
    one_at_a_time = MultichoiceJudge(model, tokenizer, batch_size=1).probabilities(questions, chains, answers)
    three_at_a_time = MultichoiceJudge(model, tokenizer, batch_size=3).probabilities(questions, chains, answers)
    assert model.training  # the judge restores the model's mode
    assert three_at_a_time == pytest.approx(one_at_a_time, abs=1e-5)
    judge = MultichoiceJudge(model, tokenizer, batch_size=3)
    per_letter = [judge.probabilities(questions, chains, [letter] * len(questions)) for letter in "ABCD"]
    totals = [sum(column) for column in zip(*per_letter)]
    assert totals == pytest.approx([1.0] * len(questions), abs=1e-5)
    assert len({round(p, 4) for p in per_letter[0]}) > 1  # different prompts, different answers


def test_judge_bad_input(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="batch_size"):
        MultichoiceJudge(tiny_model, tokenizer, batch_size=0)
    with pytest.raises(ValueError, match="choices"):
        MultichoiceJudge(tiny_model, tokenizer, choices="AΩ")
    judge = MultichoiceJudge(tiny_model, tokenizer)
    with pytest.raises(ValueError, match="chains_of_thought: got 1 for 2 questions"):
        judge.probabilities(["q1", "q2"], ["c"], ["A", "B"])
    with pytest.raises(ValueError, match=r"correct_answers\[1\]"):
        judge.probabilities(["q1", "q2"], ["c", "d"], ["A", "E"])
    with pytest.raises(TypeError, match="questions"):
        judge.probabilities("q1", ["c"], ["A"])


FILLER = ["I compared the options one by one.", "Each option needs a check.", "Let me look at the numbers.",
          "I weighed every choice."]


@pytest.fixture(scope="session")
def trained_judge_model(tokenizer):
    """A tiny Qwen2 taught to copy the letter of "... so the answer is X." into its next token after ANSWER:.

    Half of the training chains of thought state the answer and half do not (so the judge learns it
    cannot know then). Only the transformer layers train: the 151k-row embedding stays frozen (and
    a larger init keeps its letter rows apart), which keeps a step at a few tens of milliseconds.
    """
    model = tiny_qwen2(seed=0, initializer_range=0.1)
    model.get_input_embeddings().weight.requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    trainer = MultichoiceJudge(model, tokenizer, strip_answer=False)
    records, rng = synthetic_multichoice(256, seed=1), random.Random(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only spin, and badly so on a busy machine
    model.train()
    try:
        for _ in range(150):
            batch = [rng.choice(records) for _ in range(32)]
            stated = [rng.random() < 0.5 for _ in batch]
            prompts = [trainer.prompt(format_question(r["question"], r["choices"]),
                                      rng.choice(FILLER) + (f" So the answer is {r['answer']}." if says else ""))
                       for r, says in zip(batch, stated)]
            letter_probs = trainer._letter_probabilities(prompts)  # (B, L), the judge's own computation
            correct = torch.tensor(["ABCD".index(r["answer"]) for r in batch])
            loss = -letter_probs.gather(1, correct[:, None]).clamp_min(1e-12).log().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        torch.set_num_threads(threads)
    return model.eval()


@pytest.mark.slow
def test_judge_given_the_answer_scores_near_one_without_stripping(tokenizer, trained_judge_model):
    records = synthetic_multichoice(24, seed=99)
    questions = [format_question(r["question"], r["choices"]) for r in records]
    chains = [f"{FILLER[0]} So the answer is {r['answer']}." for r in records]
    answers = [r["answer"] for r in records]
    told_judge = MultichoiceJudge(trained_judge_model, tokenizer, strip_answer=False)
    judge = MultichoiceJudge(trained_judge_model, tokenizer)
    told = told_judge.probabilities(questions, chains, answers)
    stripped = judge.probabilities(questions, chains, answers)
    assert min(told) > 0.9, told
    assert sum(stripped) / len(stripped) < 0.5, stripped  # chance is 0.25
    chains = [f"{FILLER[1]}\nANSWER: {r['answer']}" for r in records]  # the marker form is stripped too
    stripped = judge.probabilities(questions, chains, answers)
    assert sum(stripped) / len(stripped) < 0.5, stripped


class StubJudge:
    def __init__(self, probabilities):
        self.values, self.calls = probabilities, []

    def probabilities(self, questions, chains_of_thought, correct_answers):
        self.calls.append((questions, chains_of_thought, correct_answers))
        return list(self.values)


def test_reward_is_model_probability_times_judge_doubt(tokenizer):
    texts = ["7 is largest.\nANSWER: B", "Hmm.\nANSWER: A", "no answer at all"]
    ids = [encode(tokenizer, t) for t in texts]
    vocab, hidden_size = 600, 8
    weight = torch.randn(vocab, hidden_size)
    views = [CompletionLogits(torch.randn(len(i), hidden_size), LinearHead(weight)) for i in ids]
    tensors = [view[0:len(view)] for view in views]  # the same rows, materialized
    answers = ["B", "C", "A"]
    judge = StubJudge([0.25, 0.5, 0.9])
    reward = multichoice_judge_reward(judge, tokenizer)
    assert reward.__name__ == "multichoice_judge_reward"
    logged = []
    got = reward(prompts=["p1", "p2", "p3"], completions=texts, completion_ids=ids, completion_logits=views,
                 answer=answers, question=["q1", "q2", "q3"],
                 log_metric=lambda name, value: logged.append((name, value)), trainer_state=None, log_extra=None)
    p_model = [extract_answer_probability_from_logits(v, i, tokenizer, a) for v, i, a in zip(views, ids, answers)]
    assert p_model[2] == 0.0 and 0.0 < p_model[0] < 1.0
    assert got == pytest.approx([p * (1 - j) for p, j in zip(p_model, [0.25, 0.5, 0.9])], rel=1e-6)
    assert judge.calls == [(["q1", "q2", "q3"], texts, answers)]
    assert [name for name, _ in logged] == ["multichoice/p_correct_model", "multichoice/p_correct_judge"]
    assert logged[0][1] == pytest.approx(sum(p_model) / 3) and logged[1][1] == pytest.approx(0.55)
    # tensors give the same rewards; without a question column the judge reads the prompt
    conversational = [[{"role": "assistant", "content": t}] for t in texts]
    assert reward(prompts=["p1", "p2", "p3"], completions=conversational, completion_ids=ids,
                  completion_logits=tensors, answer=answers) == pytest.approx(got, rel=1e-5)
    assert judge.calls[-1] == (["p1", "p2", "p3"], texts, answers)


def test_reward_bad_input(tokenizer):
    reward = multichoice_judge_reward(StubJudge([0.5]), tokenizer)
    ids = [encode(tokenizer, "ANSWER: A")]
    with pytest.raises(ValueError, match="completion_logits: not passed"):
        reward(prompts=["p"], completions=["ANSWER: A"], completion_ids=ids, answer=["A"])
    with pytest.raises(ValueError, match="answer: the dataset needs"):
        reward(prompts=["p"], completions=["ANSWER: A"], completion_ids=ids, completion_logits=[torch.randn(3, 500)])
    with pytest.raises(ValueError, match="answer: got 2 for 1"):
        reward(prompts=["p"], completions=["ANSWER: A"], completion_ids=ids, completion_logits=[torch.randn(3, 500)],
               answer=["A", "B"])
    with pytest.raises(TypeError, match="judge"):
        multichoice_judge_reward(object(), tokenizer)


def test_recomputing_fallback_equals_reading_the_policys_own_logits(tokenizer, tiny_model):
    prompts = ["Which number is the largest?\nA) 3\nB) 9\nC) 1\nD) 4\n", "What is 2 + 2?\nA) 4\nB) 5\nC) 3\nD) 1\n"]
    texts = ["9 beats the rest.\nANSWER: B", "Two and two.\nANSWER: A"]
    ids = [encode(tokenizer, t) for t in texts]
    temperature = 0.7
    head = lm_head_of(tiny_model, temperature)
    views = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, ids):
            prompt_ids = tokenizer(prompt)["input_ids"]
            hidden = final_hidden_states(tiny_model, torch.tensor([prompt_ids + completion]))[0]  # (P + C, H)
            views.append(CompletionLogits(hidden[len(prompt_ids) - 1: -1], head))
    for prompt, completion, view, letter in zip(prompts, ids, views, "BA"):
        recomputed = answer_probability_by_recomputing(tiny_model, tokenizer, prompt, completion, letter,
                                                       temperature=temperature)
        assert recomputed == pytest.approx(extract_answer_probability_from_logits(view, completion, tokenizer, letter),
                                           rel=1e-4)
    judge = StubJudge([0.1, 0.6])
    kwargs = dict(prompts=prompts, completions=texts, completion_ids=ids, answer=["B", "A"])
    with_logits = multichoice_judge_reward(judge, tokenizer)(completion_logits=views, **kwargs)
    fallback = multichoice_judge_reward(judge, tokenizer, policy=tiny_model, temperature=temperature)(**kwargs)
    assert fallback == pytest.approx(with_logits, rel=1e-4)
    assert len(set(fallback)) == 2 and all(r > 0 for r in fallback)
