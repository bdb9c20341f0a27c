"""Observations as ids (exactrl/envs/render.py) and the start-up template check (exactrl/checks/template.py).

The reference is the chat template's own render of the whole conversation: a trajectory assembled from ids (the
prompt's render, each turn's sampled ids, close_turn, each observation's ids) must decode to exactly that text on an
append-only template, with nothing the policy sampled re-encoded. Tokenizers: the built-in character one, the real
SmolLM2 (ChatML, byte-level BPE; the suite's cached build), and SmolLM2's tokenizer under two templates written here:
one that drops past <think> blocks as Qwen3's does, one that raises on a 'tool' role.
"""

from __future__ import annotations

import copy

import pytest

from exactrl.checks.template import check_template
from exactrl.envs.render import BASE, ObservationRenderer, RenderError, render
from exactrl.models.loading import load_tokenizer
from exactrl.tasks.tokenizer import build_tokenizer

# ChatML with Qwen3's rule for past reasoning: an assistant turn before the last user message loses its <think> block.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
NO_TOOL_ROLE = (
    "{%- for m in messages -%}"
    "{%- if m.role not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Conversation roles must be system, user or assistant') -}}{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return load_tokenizer(smollm2_dir)


def with_template(tok, template):
    tok = copy.deepcopy(tok)
    tok.chat_template = template
    return tok


@pytest.fixture(params=["builtin", "smollm2", "qwen3-style"])
def append_only(request):
    """A tokenizer and the observation roles its template is append-only for (Qwen3's rule: tool results only)."""
    if request.param == "builtin":
        return build_tokenizer(), ("tool", "user")
    tok = request.getfixturevalue("smollm2")
    return (tok, ("tool", "user")) if request.param == "smollm2" else (with_template(tok, QWEN3_STYLE), ("tool",))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def decode(tok, token_ids):
    return tok.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_a_trajectory_of_ids_decodes_to_the_template_render_of_the_conversation(append_only):
    """Three turns ending three ways (EOS, a stop string, the token budget) with 'tool' and 'user' observations
    between them: prompt + sampled + close_turn + observation ids, never re-encoded, decode to the full render."""
    tok, roles = append_only
    r = ObservationRenderer(tok, "template")
    conv = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 17 * 23?"}]
    traj = ids(tok, render(tok, conv, True))
    # The first turn ends with a "\n\n" sampled as two tokens, which its text does not encode back to (SmolLM2:
    # [1116], not [198, 198]; the built-in tokenizer: one <unk>, its split pattern "." not matching a newline).
    turns = [ids(tok, "<think>\ncalc\n</think>\n<tool_call>17*23</tool_call>\n") + ids(tok, "\n") + [tok.eos_token_id],
             ids(tok, "So 391.</answer>"),  # stopped on the stop string "</answer>"
             ids(tok, "The answer is 39")]  # cut at the budget
    observations = [[{"role": "tool", "content": "391"}], [{"role": roles[-1], "content": " Sure?\n"}]]
    for i, sampled in enumerate(turns):
        traj += sampled
        conv.append({"role": "assistant", "content": tok.decode(sampled, skip_special_tokens=True)})
        if i < len(observations):
            traj += r.close_turn(sampled)
            obs_ids, origin = r.observation(observations[i])
            assert len(origin) == len(obs_ids)
            traj += obs_ids
            conv += observations[i]
            assert decode(tok, traj) == render(tok, conv, True)  # what the policy reads next is the template's prompt
    traj += r.close_turn(turns[-1])
    assert decode(tok, traj) == render(tok, conv, False)
    assert ids(tok, decode(tok, traj)) != traj  # the same text re-encoded is not what was sampled


def test_close_turn_appends_only_what_the_policy_did_not_sample(smollm2):
    tok = build_tokenizer()
    r = ObservationRenderer(tok, "template")
    assert r.closing_text == "<eos>" and r.closing == [tok.eos_token_id]
    assert r.close_turn(ids(tok, "12") + [tok.eos_token_id]) == []
    assert r.close_turn(ids(tok, "12</answer>")) == [tok.eos_token_id]  # a stop string
    assert r.close_turn(ids(tok, "12")) == [tok.eos_token_id]  # the budget
    r = ObservationRenderer(smollm2, "template")
    newline = ids(smollm2, "\n")
    assert r.closing_text == "<|im_end|>\n" and r.closing == [smollm2.eos_token_id] + newline
    assert r.close_turn(ids(smollm2, "Paris") + [smollm2.eos_token_id]) == newline  # SmolLM2's EOS is <|im_end|>
    assert r.close_turn(ids(smollm2, "Paris</answer>")) == r.closing
    assert r.close_turn(ids(smollm2, "Paris")) == r.closing
    assert r.close_turn(ids(smollm2, "Paris\n")) == r.closing  # a sampled newline is the policy's, not the closing
    assert r.close_turn([]) == r.closing


def test_the_delta_is_what_the_template_appends_after_any_conversation(append_only):
    tok, roles = append_only
    r = ObservationRenderer(tok, "template")
    messages = [{"role": "tool", "content": "42"}, {"role": roles[-1], "content": "Go on."}]
    for conv in (BASE, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nx\n</think>\nY"}],
                 [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}]):
        before, after = render(tok, conv, False), render(tok, conv + messages, True)
        assert after.startswith(before)
        assert r.delta_text(messages) == after[len(before):]


def test_origins_are_environment_exactly_on_the_contents(smollm2):
    """Contents that look like the template's own text (a role's name, spaces) are told from it; the hand-written
    ChatML delta is the reference for where each content lies."""
    r = ObservationRenderer(smollm2, "template")
    contents = ["tool", " 5 ", "assistant"]
    messages = [{"role": "tool", "content": contents[0]}, {"role": "user", "content": contents[1]},
                {"role": "tool", "content": contents[2]}]
    pieces = ["<|im_start|>tool\n", "<|im_end|>\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>tool\n",
              "<|im_end|>\n<|im_start|>assistant\n"]
    obs_ids, origin = r.observation(messages)
    assert decode(smollm2, obs_ids) == "".join(p + c for p, c in zip(pieces, contents + [""], strict=True))
    runs = []  # maximal runs of one origin, decoded
    for i, o in zip(obs_ids, origin, strict=True):
        if runs and runs[-1][0] == o:
            runs[-1][1].append(i)
        else:
            runs.append((o, [i]))
    assert [(o, decode(smollm2, run)) for o, run in runs] == [
        x for p, c in zip(pieces, contents + [None], strict=True) for x in (("template", p), ("environment", c))
        if x[1] is not None]

    tok = build_tokenizer()  # one character per token: origins checked character by character
    r = ObservationRenderer(tok, "template")
    obs_ids, origin = r.observation(messages)
    text = "".join(tok.convert_ids_to_tokens(obs_ids))
    assert text == "<|tool|>tool<|user|> 5 <|tool|>assistant<|assistant|>"
    env = [i for i, o in enumerate(origin) if o == "environment"]
    expected = [i for start, c in ((8, contents[0]), (13, contents[1]), (24, contents[2]))
                for i in range(start, start + len(c))]
    assert env == expected


def test_strings_ids_and_text_mode():
    tok = build_tokenizer()
    r = ObservationRenderer(tok, "template")
    assert r.observation("ok\n") == (ids(tok, "ok\n"), ["environment"] * 3)
    assert r.observation([5, 6, 7]) == ([5, 6, 7], ["environment"] * 3)
    t = ObservationRenderer(tok, "text")
    assert t.close_turn(ids(tok, "1") + [tok.eos_token_id]) == [] and t.close_turn(ids(tok, "1")) == []
    assert t.observation([{"role": "tool", "content": "4"}, {"role": "user", "content": "2?"}]) == (
        ids(tok, "42?"), ["environment"] * 3)
    with pytest.raises(ValueError, match="env.render='jinja'"):
        ObservationRenderer(tok, "jinja")
    tok.chat_template = None
    with pytest.raises(RenderError, match="has none"):
        ObservationRenderer(tok, "template")


@pytest.mark.parametrize("name", ["builtin", "smollm2", "qwen3-style"])
def test_check_passes_append_only_templates_for_tool_observations(name, smollm2):
    tok = build_tokenizer() if name == "builtin" else smollm2 if name == "smollm2" else with_template(smollm2,
                                                                                                     QWEN3_STYLE)
    roles = ("tool",) if name == "qwen3-style" else ("tool", "user")
    check = check_template(tok, roles=roles)
    assert check.append_only, check.detail


def test_check_names_the_turn_a_template_rewrites(smollm2):
    """Qwen3's rule strips the first assistant turn's <think> block once a user message follows it."""
    check = check_template(with_template(smollm2, QWEN3_STYLE), roles=("tool", "user"))
    assert not check.append_only
    assert "'user' observations" in check.detail
    assert "turn 2 (assistant) is not an extension" in check.detail  # [system, user, assistant, ...]
    assert "with turns [system, user, assistant, user]" in check.detail
    assert "<think>" in check.detail.split("where the trajectory holds")[1]
    assert "<think>" not in check.detail.split("where the trajectory holds")[0].split("template renders")[1]


def test_check_refuses_a_template_that_cannot_render_the_role(smollm2):
    tok = with_template(smollm2, NO_TOOL_ROLE)
    assert check_template(tok, roles=("user",)).append_only
    with pytest.raises(RenderError, match=r"'tool' observations cannot be rendered.*roles must be system, user or "
                                          r"assistant.*env.render=text.*data.chat_template"):
        check_template(tok, roles=("tool",))
