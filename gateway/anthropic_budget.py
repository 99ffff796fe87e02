"""Anthropic's words for a request over a limit, as Claude Code parses them: it compacts a prompt
that is too long, and retries a context overflow with the max_tokens that fits."""

from __future__ import annotations

from .token_budget import BudgetError, Overrun

# Claude Code parses only the context overflow (`... exceed context limit: P + M > C`) and
# retries with max_tokens = C - P - 1000, unless that is under 3000 (its floor).
CLAUDE_CODE_MARGIN = 1000
CLAUDE_CODE_FLOOR = 3000


def budget_message(err: BudgetError, model: str | None = None, context: int | None = None) -> str:
    """Anthropic's own words, which Claude Code parses (it compacts a prompt that is too long and
    retries a context overflow with the max_tokens that fits). A max_tokens over the daemon's
    limit that also overflows the context is said as the overflow when Claude Code's retry then
    fits the limit; otherwise in Anthropic's words for it, naming the setting to change."""
    prompt, asked = err.prompt_tokens, err.max_tokens or 0
    if err.overrun is Overrun.MAX_TOKENS and context and prompt + asked > context:
        if context - prompt - CLAUDE_CODE_MARGIN <= err.limit:
            return budget_message(BudgetError(Overrun.CONTEXT, prompt, asked, context), model)
    if err.overrun is Overrun.CONTEXT:
        room = max(1, err.limit - prompt)
        retry = (
            ""
            if err.limit - prompt - CLAUDE_CODE_MARGIN >= CLAUDE_CODE_FLOOR
            else f" (Claude Code: set CLAUDE_CODE_MAX_OUTPUT_TOKENS to {room} or less)"
        )
        return (
            f"input length and `max_tokens` exceed context limit: {prompt} + {asked} > "
            f"{err.limit}, decrease input length or `max_tokens` and try again{retry}"
        )
    if err.overrun is Overrun.MAX_TOKENS:
        return (
            f"max_tokens: {asked} > {err.limit}, which is the maximum allowed number of output "
            f"tokens for {model or 'this model'} (the daemon's max_tokens_limit; Claude Code: "
            f"set CLAUDE_CODE_MAX_OUTPUT_TOKENS to {err.limit} or less)"
        )
    return err.message  # "prompt is too long: N tokens > M maximum"
