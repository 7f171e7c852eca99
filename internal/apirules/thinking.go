package apirules

import (
	"bytes"
	"fmt"
)

// thinkingRules checks a Messages body against the API's rules on
// thinking blocks: no empty message but a final assistant one; when
// thinking is on, a final assistant turn with a tool call starts with its
// thinking; every thinking block carries its signature (a redacted one
// its data), verifier or not; and, where the upstream verifies them
// (Rules.Thinking), every thinking block is one its account signed.
func (r *Rules) thinkingRules(body []byte) *Refusal {
	if !bytes.Contains(body, []byte(`"thinking"`)) && !bytes.Contains(body, []byte(`"redacted_thinking"`)) {
		return nil // neither asks for thinking nor carries a block
	}
	root := parse(body)
	msgs := root.Get("messages").Array()
	lastAssistant := -1
	for i, m := range msgs {
		content := m.Get("content")
		if content.IsArray() && len(content.Array()) == 0 && !(i == len(msgs)-1 && m.Get("role").Str == "assistant") {
			return r.invalid(fmt.Sprintf("messages.%d: all messages must have non-empty content except for the optional final assistant message", i))
		}
		if m.Get("role").Str != "assistant" {
			continue
		}
		lastAssistant = i
		for j, b := range content.Array() {
			switch b.Get("type").Str {
			case "thinking":
				if !b.Get("signature").Exists() {
					return r.invalid(fmt.Sprintf("messages.%d.content.%d.thinking.signature: Field required", i, j))
				}
				if r.Thinking != nil && !r.Thinking(b) {
					return r.invalid(fmt.Sprintf("messages.%d.content.%d: Invalid `signature` in `thinking` block", i, j))
				}
			case "redacted_thinking":
				if !b.Get("data").Exists() {
					return r.invalid(fmt.Sprintf("messages.%d.content.%d.redacted_thinking.data: Field required", i, j))
				}
				if r.Thinking != nil && !r.Thinking(b) {
					return r.invalid(fmt.Sprintf("messages.%d.content.%d: Invalid `data` in `redacted_thinking` block", i, j))
				}
			}
		}
	}
	if t := root.Get("thinking"); lastAssistant < 0 || !t.IsObject() || t.Get("type").Str == "disabled" {
		return nil
	}
	blocks := msgs[lastAssistant].Get("content").Array()
	tool := false
	for _, b := range blocks {
		tool = tool || b.Get("type").Str == "tool_use"
	}
	if !tool {
		return nil
	}
	if first := blocks[0].Get("type").Str; first != "thinking" && first != "redacted_thinking" {
		return r.invalid(fmt.Sprintf("messages.%d.content.0.type: Expected `thinking` or `redacted_thinking`, but found `%s`. "+
			"When `thinking` is enabled, a final `assistant` message must start with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). "+
			"We recommend you include thinking blocks from previous turns. To avoid this requirement, disable `thinking`. "+
			"Please consult our documentation at https://docs.claude.com/en/docs/build-with-claude/extended-thinking", lastAssistant, first))
	}
	return nil
}
