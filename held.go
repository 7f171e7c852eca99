package relay

import (
	"strconv"

	"github.com/caddy-relay/relay/internal/ledger"
	"github.com/caddy-relay/relay/internal/money"
	"go.uber.org/zap"
)

// held is what one config took from the process-wide pools: the entries of
// each caddy.UsagePool it holds a reference to, and the spend store. A
// config's Provision records each thing as it takes it; its Cleanup gives
// back everything, once, in the one order that is right (see release). On
// a reload the new config has taken its own references first, so what it
// shares with the old one survives.
//
// After provisioning, a key takes its state at its first request: held is
// then guarded by its relay's keysMu.
type held struct {
	channels   []*channel // channelStates entries, by their channel
	groups     []string   // groupStates entries
	keys       []string   // keyStates entries
	transports []string   // transports entries
	fleet      string     // the fleets entry; "": none
	ledger     string     // the ledger's entry in its pool; "": none
	spend      []string   // spendAccounts entries
	spendStore bool       // it uses the spend store (money.UseStore)
	decode     string     // the decodeBudgets entry; "": none
	released   bool       // release ran: state taken from now on is not given back
}

// addChannel records that the config holds ch's entry in channelStates.
func (h *held) addChannel(ch *channel) { h.channels = append(h.channels, ch) }

// addGroup records that the config holds group name's entry in groupStates.
func (h *held) addGroup(name string) { h.groups = append(h.groups, name) }

// addKey records that the config holds the entry stateID in keyStates.
func (h *held) addKey(stateID string) { h.keys = append(h.keys, stateID) }

// addTransport records that the config holds the entry key in transports.
func (h *held) addTransport(key string) { h.transports = append(h.transports, key) }

// addFleet records that the config holds the entry key in fleets.
func (h *held) addFleet(key string) { h.fleet = key }

// addLedger records that the config holds the entry key in the ledger's pool.
func (h *held) addLedger(key string) { h.ledger = key }

// addSpend records that the config holds the account id in spendAccounts.
func (h *held) addSpend(id string) { h.spend = append(h.spend, id) }

// addSpendStore records that the config uses the spend store.
func (h *held) addSpendStore() { h.spendStore = true }

// addDecode records that the config holds the entry key in decodeBudgets.
func (h *held) addDecode(key string) { h.decode = key }

// release gives back everything h holds for the config r, in this order:
// the channels' health (r stops being one of their owners), the groups',
// the keys' states, the transports; then the fleet, then the ledger, before the spend
// accounts, because the fleet's last sync, when this was its last config,
// adds their spend to the fleet's; then the spend store, whose last user
// saves the spend. A second release gives back nothing.
func (h *held) release(r *Relay) {
	for _, ch := range h.channels {
		ch.health.release(r)
		_, _ = channelStates.Delete(ch.name)
	}
	for _, name := range h.groups {
		_, _ = groupStates.Delete(name)
	}
	for _, id := range h.keys {
		_, _ = keyStates.Delete(id)
	}
	for _, k := range h.transports {
		_, _ = transports.Delete(k)
	}
	if h.fleet != "" {
		_, _ = fleets.Delete(h.fleet)
	}
	if h.ledger != "" { // its last config writes its queue out
		_ = ledger.Release(h.ledger)
	}
	for _, id := range h.spend {
		money.Drop(id)
	}
	if h.spendStore {
		money.ReleaseStore()
	}
	if h.decode != "" {
		_, _ = decodeBudgets.Delete(h.decode)
	}
	*h = held{released: true}
}

// What the relay says when a config loads: one line per relay handler with
// what it loaded, so that a first start is not silent (a status page says
// where it listens).

// logReady logs what r loaded.
func (r *Relay) logReady() {
	r.logger.Info("relay ready: "+count(len(r.Channels), "channel")+", "+count(len(r.groups), "group")+", "+count(len(r.keys), "key"),
		zap.Int("channels", len(r.Channels)), zap.Int("groups", len(r.groups)), zap.Int("keys", len(r.keys)))
}

// count is "1 key", "3 keys".
func count(n int, noun string) string {
	if n != 1 {
		noun += "s"
	}
	return strconv.Itoa(n) + " " + noun
}
