package relay

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// TestSimulatedTeamPromptCache is the simulation docs/routing.md reports:
// a team of 10 Claude Code sessions on 3 keys, with one system prompt and
// one tool set, on a group of 2 channels whose fake accounts cache prompts
// as the API does, with sticky sessions alone and with prompt-cache
// affinity too. The sessions take turns, 6 turns each; every request
// marks the system prompt and its last user turn, as Claude Code does.
// It reports the share of prompt tokens read from the cache and what the
// prompts cost at claude-sonnet-4-5's prices, and holds affinity to a
// larger share and a lower cost.
func TestSimulatedTeamPromptCache(t *testing.T) {
	_, caches, block := cacheChannels(t, "sim-on-a", "sim-on-b", "sim-off-a", "sim-off-b")
	var keys strings.Builder
	for _, g := range []string{"on", "off"} {
		for k := range 3 {
			fmt.Fprintf(&keys, "\t\tkey sk-sim-%s-%d-0123456789 sim-%s\n", g, k, g)
		}
	}
	startRelay(t, block+keys.String()+
		"\t\tgroup sim-on {\n\t\t\tchannels sim-on-a sim-on-b\n\t\t\tpolicy sticky\n\t\t}\n"+
		"\t\tgroup sim-off {\n\t\t\tchannels sim-off-a sim-off-b\n\t\t\tpolicy sticky\n\t\t\tcache_affinity off\n\t\t}\n")

	// about 12,000 tokens of tools and 3,000 of system prompt, as a coding
	// agent's
	var tools []string
	for i := range 24 {
		tools = append(tools, fmt.Sprintf(`{"name":"tool_%d","description":%q,"input_schema":{"type":"object","properties":{"path":{"type":"string"}}}}`,
			i, strings.Repeat(fmt.Sprintf("Tool %d reads, edits or runs what the agent asks. ", i), 38)))
	}
	system, _ := json.Marshal(strings.Repeat("You are the team's coding assistant. Follow the style guide. ", 200))
	const sessions, turns = 10, 6
	for _, g := range []string{"on", "off"} {
		convs := make([][]string, sessions)
		for turn := range turns {
			for s := range sessions {
				question, _ := json.Marshal(fmt.Sprintf("Session %d, turn %d: %s", s, turn, strings.Repeat("look at this code and tell me what to change. ", 20)))
				msgs := append([]string(nil), convs[s]...)
				msgs = append(msgs, `{"role":"user","content":[{"type":"text","text":`+string(question)+`,"cache_control":{"type":"ephemeral"}}]}`)
				body := `{"model":"claude-sonnet-4-5","max_tokens":16,"tools":[` + strings.Join(tools, ",") +
					`],"system":[{"type":"text","text":` + string(system) + `,"cache_control":{"type":"ephemeral"}}],"messages":[` + strings.Join(msgs, ",") + `]}`
				key := fmt.Sprintf("sk-sim-%s-%d-0123456789", g, s%3)
				r := send(t, "POST", "/v1/messages", key, body, "X-Claude-Code-Session-Id", fmt.Sprintf("team-%d", s))
				if r.status != 200 {
					t.Fatalf("%s, session %d, turn %d: %d %s", g, s, turn, r.status, r.body)
				}
				// the next turn sends this one without its mark, and the answer
				convs[s] = append(convs[s], `{"role":"user","content":[{"type":"text","text":`+string(question)+`}]}`,
					`{"role":"assistant","content":[{"type":"text","text":"cached"}]}`)
			}
		}
	}

	// claude-sonnet-4-5: $3 input, $3.75 cache write, $0.30 cache read per
	// million tokens
	figures := map[string][2]float64{}
	for _, g := range []string{"on", "off"} {
		var input, read, written int
		for _, ch := range []string{"a", "b"} {
			i, r, w := caches["sim-"+g+"-"+ch].Totals()
			input, read, written = input+i, read+r, written+w
		}
		share := float64(read) / float64(input+read+written)
		cost := (float64(input)*3 + float64(written)*3.75 + float64(read)*0.3) / 1e6
		figures[g] = [2]float64{share, cost}
		t.Logf("%-16s input %7d  cache read %8d  cache write %7d  read share %.1f%%  prompt cost $%.4f",
			map[string]string{"on": "affinity+sticky", "off": "sticky only"}[g], input, read, written, 100*share, cost)
	}
	on, off := figures["on"], figures["off"]
	if on[0] <= off[0] || on[1] >= off[1] {
		t.Errorf("affinity: read share %.3f, cost $%.4f; sticky only: %.3f, $%.4f; want a larger share and a lower cost", on[0], on[1], off[0], off[1])
	}
	t.Logf("affinity saves %.1f%% of the prompts' cost", 100*(1-on[1]/off[1]))
}
