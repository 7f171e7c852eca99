package openai

import (
	"strconv"

	"github.com/caddy-relay/relay/internal/rope"
	"github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// chatTools is a request's tools, each checked and encoded as a Messages
// tool as it is decoded; the first one refused waits (err) for its turn
// among the parameters.
type chatTools struct {
	n    int
	err  *ParamError
	out  rope.Rope // the tools, comma-separated
	tool chatTool  // the one being decoded
	msg  msgTool
}

// UnmarshalJSONFrom implements json.UnmarshalerFrom.
func (t *chatTools) UnmarshalJSONFrom(dec *jsontext.Decoder) error {
	var err error
	t.n, err = eachElement(dec, &t.tool, nil, func(i int) {
		if t.err == nil {
			t.err = t.add(i)
		}
	})
	return err
}

// add encodes tool i.
func (t *chatTools) add(i int) *ParamError {
	f := &t.tool.Function
	at := func() string { return "tools[" + strconv.Itoa(i) + "]" }
	if t.tool.Type != "function" {
		return badParam(at()+".type", "only function tools are supported")
	}
	if f.Name == "" {
		return badParam(at()+".function.name", "required")
	}
	schema := f.Parameters
	if len(schema) == 0 || schema.Kind() == 'n' {
		schema = emptySchema
	} else if schema.Kind() != '{' {
		return badParam(at()+".function.parameters", "must be a JSON schema object")
	}
	t.msg = msgTool{Name: f.Name, Description: f.Description, InputSchema: schema, Strict: f.Strict}
	sep(&t.out)
	if err := json.MarshalWrite(&t.out, &t.msg); err != nil {
		return errTranslation(err)
	}
	return nil
}

// translateTools carries tools, tool_choice and parallel_tool_calls over.
func translateTools(r *chatRequest, out *msgFrame) *ParamError {
	if r.Tools.err != nil {
		return r.Tools.err
	}
	if r.Tools.n > 0 {
		out.Tools = out.spliced.add("tools", &r.Tools.out)
	}
	if len(r.ToolChoice) > 0 && r.ToolChoice.Kind() != 'n' {
		var tc msgToolChoice
		if r.ToolChoice.Kind() == '"' {
			var s string
			_ = json.Unmarshal(r.ToolChoice, &s)
			switch s {
			case "none":
				tc.Type = "none"
			case "auto":
				tc.Type = "auto"
			case "required":
				tc.Type = "any"
			default:
				return badParam("tool_choice", "must be none, auto, required or a function")
			}
		} else {
			var named chatToolChoice
			if err := json.Unmarshal(r.ToolChoice, &named); err != nil || named.Type != "function" || named.Function.Name == "" {
				return badParam("tool_choice", "must be none, auto, required or {\"type\":\"function\",\"function\":{\"name\":...}}")
			}
			tc.Type, tc.Name = "tool", named.Function.Name
		}
		out.ToolChoice = &tc
	}
	if p := r.ParallelToolCalls; p != nil && !*p && r.Tools.n > 0 {
		if out.ToolChoice == nil {
			out.ToolChoice = &msgToolChoice{Type: "auto"}
		}
		if out.ToolChoice.Type != "none" {
			out.ToolChoice.DisableParallelToolUse = true
		}
	}
	return nil
}
