// caddy-relay status page. Everything from clients and upstreams goes into
// the page as text (textContent), never as markup.
"use strict";
(function () {
	const $ = (id) => document.getElementById(id);
	let offset = 0; // server clock minus ours, in ms
	let state = null;
	let rows = []; // the requests, the oldest first
	let es = null;

	function el(tag, text, cls) {
		const e = document.createElement(tag);
		if (text !== undefined && text !== null) e.textContent = String(text);
		if (cls) e.className = cls;
		return e;
	}
	function cell(tr, text, cls) { const td = el("td", text, cls); tr.appendChild(td); return td; }
	function fill(tbody, items, render) {
		const frag = document.createDocumentFragment();
		for (const it of items) frag.appendChild(render(it));
		tbody.replaceChildren(frag);
		// a column of numbers has its header over them, on the right
		const first = tbody.rows[0], head = tbody.parentElement.tHead;
		if (first && head) {
			const ths = head.rows[0].cells;
			for (let i = 0; i < first.cells.length && i < ths.length; i++) {
				ths[i].classList.toggle("num", first.cells[i].classList.contains("num"));
			}
		}
	}
	// dollars: cents from $1 up, two significant digits below (as the
	// relay's own messages write them), so a cheap request is not $0.0000
	function money(v) {
		if (v === undefined || v === null) return "";
		v = Number(v);
		let d = 2;
		if (v > 0 && v < 1) d = Math.min(Math.max(2, 1 - Math.floor(Math.log10(v))), 10);
		let s = v.toFixed(d);
		if (d > 2) {
			s = s.replace(/0+$/, "");
			if (s.length - s.indexOf(".") - 1 < 2) s = v.toFixed(2);
		}
		return "$" + s;
	}
	function msText(v) { return v > 0 ? (v >= 1000 ? (v / 1000).toFixed(2) + " s" : Math.round(v) + " ms") : ""; }
	function left(until) {
		if (!until) return "";
		const s = Math.ceil((Date.parse(until) - (Date.now() + offset)) / 1000);
		if (s <= 0) return "";
		return s >= 60 ? Math.floor(s / 60) + "m " + (s % 60) + "s" : s + "s";
	}

	// a cooling class and its time left; "" once it has ended
	function classText(name, until) {
		const l = left(until);
		return l ? name + " " + l : "";
	}

	const svgNS = "http://www.w3.org/2000/svg";
	function spark(counts, errors) {
		const svg = document.createElementNS(svgNS, "svg");
		svg.setAttribute("class", "spark");
		svg.setAttribute("viewBox", "0 0 90 20");
		const top = Math.max(1, ...counts);
		const line = (vals, cls) => {
			const p = document.createElementNS(svgNS, "polyline");
			p.setAttribute("points", vals.map((v, i) => (i * 10) + "," + (19 - (v / top) * 18).toFixed(1)).join(" "));
			if (cls) p.setAttribute("class", cls);
			svg.appendChild(p);
		};
		line(counts, "");
		if (errors.some((v) => v > 0)) line(errors, "err");
		const t = document.createElementNS(svgNS, "title");
		t.textContent = "attempts per minute: " + counts.join(" ") + "; failed: " + errors.join(" ");
		svg.appendChild(t);
		return svg;
	}

	function act(name, action) {
		if (!window.confirm(action + " channel " + name + "?")) return;
		fetch("channels/" + encodeURIComponent(name) + "/" + action, { method: "POST", credentials: "same-origin" })
			.then((r) => r.ok ? null : r.json().then((b) => { throw new Error(b.error || r.statusText); }))
			.catch((e) => window.alert(action + " " + name + ": " + e.message));
	}

	function renderChannels() {
		fill($("channels").tBodies[0], state.channels, (c) => {
			const tr = el("tr");
			tr.dataset.channel = c.name;
			const name = cell(tr, c.name, "mono");
			name.title = c.provider || "";
			let shown = c.state;
			if (shown === "healthy" && c.busy) shown = "busy";
			const b = el("span", shown.replace("_", " "), "badge " + shown);
			b.dataset.state = c.state;
			cell(tr, "").appendChild(b);
			const cd = cell(tr, left(c.cooldown_until || c.busy_until || c.capped_until), "num countdown");
			cd.dataset.until = c.cooldown_until || c.busy_until || c.capped_until || "";
			const cc = cell(tr, "", "classes");
			for (const name of Object.keys(c.classes || {}).sort()) {
				const k = c.classes[name];
				const s = el("span", classText(name, k.until), "class-cooling");
				s.dataset.class = name;
				s.dataset.until = k.until;
				s.title = k.reason || "";
				cc.appendChild(s);
			}
			cell(tr, c.inflight, "num");
			const r = c.recent;
			cell(tr, r.per_minute[r.per_minute.length - 1], "num");
			// what came before a reset (in the last 5 minutes) is marked so
			const resetAt = c.reset_at ? Date.parse(c.reset_at) : 0;
			const rate = cell(tr, r.error_ratio > 0 ? Math.round(r.error_ratio * 100) + "%" : "0%", "num errors" + (r.error_ratio > 0.2 ? " bad" : ""));
			if (r.error_ratio > 0 && resetAt > Date.now() + offset - 5 * 60 * 1000) {
				rate.classList.add("before-reset");
				rate.title = "includes attempts from before the reset at " + new Date(resetAt).toLocaleTimeString();
			}
			cell(tr, msText(r.first_byte_p50_ms), "num");
			cell(tr, "").appendChild(spark(r.per_minute, r.errors_per_minute));
			const err = c.last_error ? c.last_error + (c.last_error_reason ? ": " + c.last_error_reason : "") : "";
			const old = err && resetAt && Date.parse(c.last_error_at) <= resetAt;
			const e = cell(tr, old ? "before the reset: " + err : err, "wrap last-error" + (old ? " before-reset" : ""));
			if (c.last_error_at) e.title = c.last_error_at;
			cell(tr, (c.groups || []).join(" "));
			const btns = cell(tr, "");
			for (const a of [c.state === "disabled" ? "enable" : "disable", "reset"]) {
				const bt = el("button", a);
				bt.type = "button";
				bt.dataset.action = a;
				bt.addEventListener("click", () => act(c.name, a));
				btns.appendChild(bt);
			}
			return tr;
		});
	}

	function renderGroups() {
		fill($("groups").tBodies[0], state.groups, (g) => {
			const tr = el("tr");
			cell(tr, g.name, "mono");
			for (const p of ["realtime", "normal", "batch"]) cell(tr, g.queue[p] || 0, "num" + (g.queue[p] > 0 ? " warn" : ""));
			const spend = cell(tr, "", "num");
			for (const p of ["day", "week", "month", "total"]) {
				const spent = g.spend_usd ? g.spend_usd[p] : undefined;
				const cap = g.budget_usd ? g.budget_usd[p] : undefined;
				if (spent === undefined) continue;
				const line = el("div", p + " " + money(spent) + (cap ? " / " + money(cap) : ""));
				if (cap) {
					const m = el("meter");
					m.min = 0; m.max = cap; m.low = cap * 0.75; m.high = cap * 0.9; m.optimum = 0;
					m.value = Math.min(spent || 0, cap);
					line.appendChild(document.createTextNode(" "));
					line.appendChild(m);
				}
				spend.appendChild(line);
			}
			cell(tr, g.held_usd ? money(g.held_usd) : "", "num");
			return tr;
		});
	}

	function renderKeys() {
		const shown = (state.keys || []).length, total = state.keys_total || 0;
		$("keys-count").textContent = shown < total ? "(" + shown + " of " + total + " keys: those in use)" : "";
		fill($("keys").tBodies[0], state.keys, (k) => {
			const tr = el("tr");
			cell(tr, k.name, "mono");
			cell(tr, k.group);
			cell(tr, k.priority);
			cell(tr, k.limits ? k.limits.inflight : "", "num");
			for (const p of ["day", "week", "month", "total"]) {
				const spent = k.spend_usd ? k.spend_usd[p] : undefined;
				const cap = k.budget_usd ? k.budget_usd[p] : undefined;
				const td = cell(tr, "", "num");
				td.appendChild(el("span", money(spent) + (cap ? " / " + money(cap) : "")));
				if (cap) {
					const m = el("meter");
					m.min = 0; m.max = cap; m.low = cap * 0.75; m.high = cap * 0.9; m.optimum = 0;
					m.value = Math.min(spent || 0, cap);
					td.appendChild(document.createTextNode(" "));
					td.appendChild(m);
				}
			}
			cell(tr, k.held_usd ? money(k.held_usd) : "", "num");
			cell(tr, k.disabled ? "disabled" : k.expired ? "expired" : "", "bad");
			return tr;
		});
	}

	function renderSessions() {
		fill($("sessions").tBodies[0], state.sessions || [], (x) => {
			const tr = el("tr");
			cell(tr, x.session, "mono");
			cell(tr, x.key, "mono");
			cell(tr, x.group);
			const td = cell(tr, "", "num");
			if (x.budget_usd) {
				td.appendChild(el("span", money(x.window_spend_usd || 0) + " / " + money(x.budget_usd)));
				const m = el("meter");
				m.min = 0; m.max = x.budget_usd; m.low = x.budget_usd * 0.75; m.high = x.budget_usd * 0.9; m.optimum = 0;
				m.value = Math.min(x.window_spend_usd || 0, x.budget_usd);
				td.appendChild(document.createTextNode(" "));
				td.appendChild(m);
			} else {
				td.textContent = money(x.spend_usd);
			}
			cell(tr, x.held_usd ? money(x.held_usd) : "", "num");
			cell(tr, x.requests, "num");
			cell(tr, x.loop_guard_hits || "", "num" + (x.loop_guard_hits ? " bad" : ""));
			const t = cell(tr, new Date(x.last_seen).toLocaleTimeString());
			t.title = x.last_seen;
			return tr;
		});
	}

	function renderFleet() {
		const box = $("fleet-box");
		box.hidden = !state.fleet && !state.fleet_error;
		$("fleet-error").hidden = !state.fleet_error;
		$("fleet-error").textContent = state.fleet_error || "";
		fill($("fleet").tBodies[0], state.fleet || [], (n) => {
			const tr = el("tr");
			cell(tr, n.id + (n.id === state.node ? " (this)" : ""), "mono");
			cell(tr, "").appendChild(el("span", n.state, "badge " + (n.state === "up" ? "healthy" : "open")));
			cell(tr, n.address, "mono");
			cell(tr, n.version);
			cell(tr, n.last_seen);
			return tr;
		});
	}

	// the Spend view: cost by day per group as stacked bars, drawn here
	function spendChart(v) {
		const svg = $("spend-chart");
		// drawn to the width it has, so its text is not scaled
		const width = Math.max(svg.clientWidth, 320), H = 150, X = 56, n = v.days.length;
		const W = (width - X - 4) / n;
		svg.setAttribute("viewBox", "0 0 " + width + " " + (H + 24));
		const totals = v.days.map((_, i) => v.groups.reduce((a, g) => a + g.cost_usd[i], 0));
		const top = Math.max(...totals) || 1;
		const kids = [];
		const node = (tag, attrs, text) => {
			const e = document.createElementNS(svgNS, tag);
			for (const k in attrs) e.setAttribute(k, attrs[k]);
			if (text !== undefined) e.textContent = text;
			return e;
		};
		kids.push(node("line", { x1: X, y1: H + 0.5, x2: X + n * W, y2: H + 0.5, class: "axis" }));
		kids.push(node("text", { x: X - 4, y: 10, "text-anchor": "end" }, money(top)));
		kids.push(node("text", { x: X - 4, y: H, "text-anchor": "end" }, "$0"));
		v.days.forEach((day, i) => {
			const g = node("g", { class: "day", "data-day": day });
			let y = H;
			v.groups.forEach((grp, j) => {
				const c = grp.cost_usd[i];
				if (!(c > 0)) return;
				const h = Math.max(1, c / top * (H - 12));
				y -= h;
				const r = node("rect", { x: (X + i * W + W * 0.15).toFixed(1), y: y.toFixed(1), width: (W * 0.7).toFixed(1), height: h.toFixed(1), class: "c" + (j % 8) });
				r.dataset.group = grp.name;
				r.dataset.cost = String(c);
				g.appendChild(r);
			});
			const lines = v.groups.filter((grp) => grp.cost_usd[i] > 0).map((grp) => grp.name + " " + money(grp.cost_usd[i]));
			g.appendChild(node("title", {}, day + ": " + money(totals[i]) + (lines.length ? "\n" + lines.join("\n") : "")));
			if ((n - 1 - i) % 7 === 0) { // a label a week, today's the last
				g.appendChild(node("text", { x: X + i * W + W / 2, y: H + 16, "text-anchor": "middle" }, day.slice(5)));
			}
			kids.push(g);
		});
		svg.replaceChildren(...kids);
		const legend = $("spend-legend");
		legend.replaceChildren(...v.groups.map((grp, j) => {
			const li = el("li", null, "c" + (j % 8));
			li.dataset.group = grp.name;
			li.appendChild(el("span", grp.name + " " + money(grp.cost_usd.reduce((a, b) => a + b, 0))));
			return li;
		}));
	}

	function renderSpend(v) {
		$("spend-notice").hidden = !v.notice;
		$("spend-notice").textContent = v.notice ? "Spend: " + v.notice : "";
		const shown = v.ledger && !v.notice;
		$("spend-body").hidden = !shown;
		$("spend-csv").hidden = !shown;
		$("spend-total").textContent = shown ? "(" + money(v.total_usd) + ")" : "";
		if (!shown) return;
		spendChart(v);
		for (const [id, list] of [["spend-keys", v.top_keys], ["spend-models", v.top_models]]) {
			fill($(id).tBodies[0], list, (t) => {
				const tr = el("tr");
				tr.dataset.name = t.name;
				cell(tr, t.name, "mono");
				cell(tr, t.requests, "num");
				cell(tr, money(t.cost_usd), "num");
				return tr;
			});
		}
	}

	function loadSpend() {
		fetch("spend", { credentials: "same-origin" })
			.then((r) => r.json())
			.then(renderSpend)
			.catch(() => {}); // the next load tries again
	}

	function matches(r, q, only) {
		if (only === "errors" && r.status < 400) return false;
		if (only === "ok" && r.status >= 400) return false;
		if (!q) return true;
		return r.id.toLowerCase().includes(q) || r.key.toLowerCase().includes(q) ||
			r.model.toLowerCase().includes(q) || r.chain.some((c) => c.toLowerCase().includes(q));
	}

	function renderRequests() {
		const q = $("search").value.trim().toLowerCase();
		const only = $("only").value;
		const shown = [];
		for (let i = rows.length - 1; i >= 0; i--) if (matches(rows[i], q, only)) shown.push(rows[i]);
		$("count").textContent = shown.length === rows.length ? "(" + rows.length + ")" : "(" + shown.length + " of " + rows.length + ")";
		fill($("requests").tBodies[0], shown, (r) => {
			const tr = el("tr");
			tr.dataset.id = r.id;
			const t = cell(tr, new Date(r.at).toLocaleTimeString());
			t.title = r.at;
			// long values are cut (ids, keys, models) or wrapped between
			// channels to fit the width, whole in their title
			for (const [text, cls] of [[r.id, "mono trunc"], [r.key, "mono key trunc"],
				[r.model + (r.served ? " → " + r.served : ""), "mono model trunc"], [r.chain.join(" → "), "mono chain"]]) {
				cell(tr, text, cls).title = text;
			}
			cell(tr, r.attempts, "num");
			cell(tr, r.status, "num" + (r.status >= 400 ? " bad" : ""));
			cell(tr, msText(r.first_byte_ms), "num");
			cell(tr, r.input_tokens + " / " + r.output_tokens, "num");
			cell(tr, r.cost_usd > 0 ? money(r.cost_usd) : "", "num");
			cell(tr, r.code || "", "bad");
			return tr;
		});
	}

	function tick() {
		for (const td of document.querySelectorAll("td.countdown")) td.textContent = left(td.dataset.until);
		for (const s of document.querySelectorAll("span.class-cooling")) s.textContent = classText(s.dataset.class, s.dataset.until);
	}

	function connect() {
		es = new EventSource("events");
		es.addEventListener("open", () => {
			rows = []; // the stream starts with every row it has
			loadSpend();
			$("live").textContent = "live";
			$("live").className = "live on";
		});
		es.addEventListener("state", (ev) => {
			const m = JSON.parse(ev.data);
			offset = Date.parse(m.now) - Date.now();
			state = m.state;
			$("node").textContent = "node " + state.node;
			renderChannels();
			renderGroups();
			renderKeys();
			renderSessions();
			renderFleet();
		});
		es.addEventListener("requests", (ev) => {
			const add = JSON.parse(ev.data);
			rows = rows.concat(add);
			if (rows.length > 1000) rows = rows.slice(rows.length - 1000);
			renderRequests();
		});
		es.addEventListener("error", () => {
			$("live").textContent = "reconnecting";
			$("live").className = "live off";
			if (es.readyState === EventSource.CLOSED) { // the browser gave up: start over
				es.close();
				setTimeout(connect, 2000);
			}
		});
	}

	document.addEventListener("DOMContentLoaded", () => {
		$("search").addEventListener("input", renderRequests);
		$("only").addEventListener("change", renderRequests);
		setInterval(tick, 1000);
		setInterval(loadSpend, 30000);
		connect();
	});
})();
