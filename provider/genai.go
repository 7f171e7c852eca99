package provider

// GenAINamer is implemented by a provider whose upstream OpenTelemetry's
// GenAI semantic conventions name. The relay sets the attribute
// gen_ai.provider.name of its spans to the name: of each attempt's span,
// the channel's, and of the request's, the channel that answered. A
// provider without it is named by its module's name (`provider <name>`).
type GenAINamer interface {
	// GenAIProviderName is the value of gen_ai.provider.name for the
	// provider's upstream: one of the conventions' well-known values when
	// one names it (anthropic, aws.bedrock, gcp.vertex_ai, openai, ...),
	// which says which flavour of the conventions the telemetry follows;
	// else a name of the provider's own. It is constant, and asked once,
	// when the config loads.
	GenAIProviderName() string
}
