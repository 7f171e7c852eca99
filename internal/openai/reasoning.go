package openai

// reasoningBudgets are the thinking budgets (budget_tokens) each
// reasoning_effort stands for, both ways: the budget an effort asks for,
// and the least effort whose budget holds a budget. "none" asks for no
// thinking.
var reasoningBudgets = map[string]int64{
	"none":    0,
	"minimal": 1024,
	"low":     4096,
	"medium":  8192,
	"high":    16384,
	"xhigh":   24576,
}

// minThinkingBudget is the smallest budget_tokens Messages accepts.
const minThinkingBudget = 1024

// reasoningEffort is the reasoning_effort of a thinking config: the
// effort the client gave, else the effort its budget asks for.
func reasoningEffort(t *msgThinking, oc *msgOutputConfig) string {
	if oc != nil && oc.Effort != "" {
		switch oc.Effort {
		case "max":
			return "xhigh"
		default:
			return oc.Effort
		}
	}
	if t == nil || t.Type == "disabled" {
		return ""
	}
	switch b := t.BudgetTokens; {
	case t.Type == "adaptive":
		return "medium"
	case b <= reasoningBudgets["minimal"]:
		return "minimal"
	case b <= reasoningBudgets["low"]:
		return "low"
	case b <= reasoningBudgets["medium"]:
		return "medium"
	case b <= reasoningBudgets["high"]:
		return "high"
	}
	return "xhigh"
}
