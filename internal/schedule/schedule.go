// Package schedule validates TransformerEngine's pipeline-parallel _order and
// expands it into the steps that warmup and capture run, in order.
//
// An _order lists model-chunk ids (1-based) in the order a pipeline rank
// runs them: c > 0 runs chunk c's forward for its next microbatch, -c its
// backward (data gradient) for its next microbatch, and -(c+0.5) the delayed
// weight-gradient pass that pairs with chunk c's latest backward. Each entry
// runs every layer of the chunk: forwards in layer order, backwards in
// reverse. Layers are callables; the graphed passes are indexed as
// TransformerEngine indexes its sample_args and returned callables:
//
//	pass = prefix[c]*microbatches + microbatch*layers[c] + layer
//
// where prefix[c] is the number of layers in the chunks before c.
//
// Build checks every rule TransformerEngine relies on (and several it only
// trips over with a KeyError) and names the offending entry. It knows
// nothing about tensors or modules: whether a pass needs a weight-gradient
// graph is learnt in warmup, after planning, so that pairing check is made
// by the capture planner (internal/lifetime) against what warmup learned.
package schedule

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// ErrInvalid is wrapped by every error that reports a malformed schedule (as
// opposed to a malformed encoding of one).
var ErrInvalid = errors.New("invalid schedule")

func invalidf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
}

// StepKind is what a step computes.
type StepKind byte

// Step kinds.
const (
	Forward  StepKind = 'F'
	Backward StepKind = 'B'
	WGrad    StepKind = 'W' // delayed weight gradient
)

func (k StepKind) String() string {
	switch k {
	case Forward:
		return "forward"
	case Backward:
		return "backward"
	case WGrad:
		return "weight-gradient"
	}
	return fmt.Sprintf("StepKind(%q)", byte(k))
}

// Entry is one parsed _order entry.
type Entry struct {
	Index int    // position in _order
	Text  string // the entry as given
	Chunk int    // 1-based chunk id (0 only in entries that fail validation)
	Kind  StepKind
}

func (e Entry) String() string { return fmt.Sprintf("_order entry %d (%s)", e.Index, e.Text) }

// MaxChunk bounds chunk ids, microbatches, layers and pass counts, so that
// index arithmetic cannot overflow and a hostile order cannot make Build
// allocate without limit.
const MaxChunk = 1 << 20

// ParseOrder parses _order as Python's encoding sends it: entries separated
// by commas, each an integer ("2", "-1") or a decimal ("-1.5", "-2.0"). The
// sign and fraction decide the kind: a positive integer is a forward, a
// negative integer (or a negative decimal with fraction 0) a backward, and a
// negative decimal with fraction exactly .5 the weight-gradient pass of
// chunk |entry|-0.5. Anything else is an error naming the entry and the rule.
func ParseOrder(s string) ([]Entry, error) {
	if strings.TrimSpace(s) == "" {
		return nil, invalidf("_order is empty; it must list each chunk's forward and backward entries")
	}
	fields := strings.Split(s, ",")
	if len(fields) > 4*MaxChunk {
		return nil, invalidf("_order has %d entries; at most %d are supported", len(fields), 4*MaxChunk)
	}
	out := make([]Entry, 0, len(fields))
	for i, f := range fields {
		e, err := parseEntry(i, strings.TrimSpace(f))
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, nil
}

func parseEntry(i int, text string) (Entry, error) {
	e := Entry{Index: i, Text: text}
	body, neg := text, false
	if strings.HasPrefix(body, "-") {
		body, neg = body[1:], true
	} else if strings.HasPrefix(body, "+") {
		body = body[1:]
	}
	whole, frac, hasFrac := strings.Cut(body, ".")
	if !digitsOnly(whole) || (hasFrac && !digitsOnly(frac)) {
		return e, invalidf("%s is not a chunk id: entries are integers c (forward of chunk c), -c (backward) or -(c+0.5) (weight gradient)", e)
	}
	c, err := strconv.Atoi(whole)
	if err != nil || c > MaxChunk {
		return e, invalidf("%s: chunk ids above %d are not supported", e, MaxChunk)
	}
	frac = strings.TrimRight(frac, "0")
	switch {
	case frac == "" && c == 0:
		return e, invalidf("%s: chunk ids are 1-based; 0 names no chunk", e)
	case frac == "" && !neg:
		if hasFrac {
			return e, invalidf("%s: forward entries must be integers, got a float (TransformerEngine: \"Forward order value must be an integer\")", e)
		}
		e.Chunk, e.Kind = c, Forward
	case frac == "":
		e.Chunk, e.Kind = c, Backward
	case !neg:
		return e, invalidf("%s: forward entries must be integers; only a negative -(c+0.5) entry may have a fraction (the weight-gradient pass of chunk c)", e)
	case frac != "5":
		return e, invalidf("%s: a weight-gradient entry must be exactly -(c+0.5) (TransformerEngine: \"the order diff of wgrad and dgrad must be 0.5\")", e)
	default:
		e.Chunk, e.Kind = c, WGrad
	}
	return e, nil
}

func digitsOnly(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if r < '0' || r > '9' {
			return false
		}
	}
	return true
}

// ParseLayers parses _num_layers_per_chunk as Python's encoding sends it: ""
// when it was not given, "*L" when it was one integer (every chunk has L
// layers), or a comma-separated list with one count per chunk.
func ParseLayers(s string) (layers []int, scalar bool, err error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return nil, false, nil
	}
	if rest, ok := strings.CutPrefix(s, "*"); ok {
		s, scalar = rest, true
	}
	for i, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		n, err := strconv.Atoi(f)
		if err != nil || f == "" {
			return nil, false, invalidf("_num_layers_per_chunk[%d] (%q) is not an integer", i, f)
		}
		if n < 1 || n > MaxChunk {
			return nil, false, invalidf("_num_layers_per_chunk[%d] = %d: every chunk needs at least one layer (and at most %d)", i, n, MaxChunk)
		}
		layers = append(layers, n)
	}
	if scalar && len(layers) != 1 {
		return nil, false, fmt.Errorf("layers encoding %q: \"*\" takes one integer", s)
	}
	return layers, scalar, nil
}

// Spec is what Build validates.
type Spec struct {
	Order        []Entry
	Layers       []int // _num_layers_per_chunk; nil when not given
	LayersScalar bool  // Layers was one integer for every chunk
	NumCallables int   // len(callables)
	NumSamples   int   // len(sample_args)
	Training     bool  // the callables run backward (TE: all modules in training mode)
	WarmupIters  int   // num_warmup_iters
}

// Step is one warmup/capture step: one layer of one order entry.
type Step struct {
	Kind     StepKind
	Pass     int // the graphed pass (TE's per-callable index)
	Callable int // index into callables
	Entry    int // the _order entry it expands (-1 in a default schedule)
	Chunk    int // 1-based chunk (0 in a default schedule)
	Layer    int // layer within its chunk
	Micro    int // microbatch
}

// Plan is a validated, expanded schedule.
type Plan struct {
	Ordered      bool  // from an _order (false: the default fwd 0..n-1, bwd n-1..0)
	Chunks       int   // model chunks (1 in a default schedule)
	Microbatches int   // microbatches per chunk (1 in a default schedule)
	Layers       []int // layers per chunk
	Callables    int
	Passes       int
	Steps        []Step
}

// Prefix returns the number of layers in the chunks before chunk c (1-based).
func (p *Plan) Prefix(c int) int {
	n := 0
	for i := 0; i < c-1 && i < len(p.Layers); i++ {
		n += p.Layers[i]
	}
	return n
}

// PassIndex is TransformerEngine's index of layer l of chunk c (1-based) for
// microbatch m.
func (p *Plan) PassIndex(c, m, l int) int {
	return p.Prefix(c)*p.Microbatches + m*p.Layers[c-1] + l
}

// Default is the schedule without an _order, as torch and TransformerEngine
// capture: every callable's forward in order, then (training) every
// backward in reverse order. Pass i is callable i.
func Default(numCallables int, training bool) (*Plan, error) {
	if numCallables < 1 || numCallables > MaxChunk {
		return nil, invalidf("%d callables: need between 1 and %d", numCallables, MaxChunk)
	}
	p := &Plan{Chunks: 1, Microbatches: 1, Layers: []int{numCallables}, Callables: numCallables, Passes: numCallables}
	for i := 0; i < numCallables; i++ {
		p.Steps = append(p.Steps, Step{Kind: Forward, Pass: i, Callable: i, Entry: -1, Layer: i})
	}
	if training {
		for i := numCallables - 1; i >= 0; i-- {
			p.Steps = append(p.Steps, Step{Kind: Backward, Pass: i, Callable: i, Entry: -1, Layer: i})
		}
	}
	return p, nil
}

// Build validates spec against TransformerEngine's rules and expands it.
func Build(spec Spec) (*Plan, error) {
	order := spec.Order
	if len(order) == 0 {
		return nil, invalidf("_order is empty; it must list each chunk's forward and backward entries")
	}
	if spec.NumCallables < 1 || spec.NumSamples < 1 {
		return nil, invalidf("need at least one callable and one sample_args entry (got %d and %d)", spec.NumCallables, spec.NumSamples)
	}
	if spec.Training && spec.WarmupIters < 1 {
		return nil, invalidf("num_warmup_iters=%d with _order: warmup must run at least once, since it discovers which passes need a delayed weight-gradient graph (TransformerEngine fails here with a KeyError)", spec.WarmupIters)
	}

	chunks, micro, nonW, firstW, err := countOrder(spec)
	if err != nil {
		return nil, err
	}
	layers, total, err := chunkLayers(spec, chunks, micro, firstW)
	if err != nil {
		return nil, err
	}
	p := &Plan{Ordered: true, Chunks: chunks, Microbatches: micro, Layers: layers, Callables: total, Passes: total * micro}
	if err := p.addSteps(order, spec.Training, nonW); err != nil {
		return nil, err
	}
	// The counts add up to chunks*micro*2, no chunk ran more than micro of
	// either kind, and no backward outran its forward: so every chunk ran
	// each microbatch exactly once forward and (training) once backward.
	return p, nil
}

// countOrder returns the chunk count (the largest forward chunk id), the
// microbatch count, the number of forward/backward entries and the first
// weight-gradient entry (nil if none), as TransformerEngine infers them.
func countOrder(spec Spec) (chunks, micro, nonW int, firstW *Entry, err error) {
	order := spec.Order
	for i := range order {
		e := &order[i]
		switch e.Kind {
		case Forward:
			chunks = max(chunks, e.Chunk)
		}
		if !spec.Training && e.Kind != Forward {
			return 0, 0, 0, nil, invalidf("%s: the callables are in eval mode, so no backward graphs are captured and _order must list forward entries only (TransformerEngine fails here with a KeyError)", e)
		}
		if e.Kind == WGrad {
			if firstW == nil {
				firstW = e
			}
			continue
		}
		nonW++
	}
	if chunks == 0 {
		return 0, 0, 0, nil, invalidf("_order has no forward entries (positive chunk ids)")
	}
	perChunk := 2
	if !spec.Training {
		perChunk = 1
	}
	micro = nonW / chunks / perChunk
	if micro < 1 || chunks*micro*perChunk != nonW {
		what := "* 2 (forward and backward)"
		if !spec.Training {
			what = "(forward only, eval mode)"
		}
		return 0, 0, 0, nil, invalidf("_order has %d forward/backward entries, not num_model_chunks (%d, its largest forward chunk id) * num_microbatches %s: every chunk must run each microbatch once forward%s (TransformerEngine: \"Pipeline-parallel order dimension mismatch\")",
			nonW, chunks, what, map[bool]string{true: " and once backward", false: ""}[spec.Training])
	}

	return chunks, micro, nonW, firstW, nil
}

// chunkLayers returns the layers of each chunk (from _num_layers_per_chunk,
// or inferred from the sample count) and their sum, checked against the
// callables and samples given.
func chunkLayers(spec Spec, chunks, micro int, firstW *Entry) ([]int, int, error) {
	layers := spec.Layers
	switch {
	case layers == nil:
		if firstW != nil {
			return nil, 0, invalidf("%s: weight-gradient entries need _num_layers_per_chunk, with one layer per chunk (TransformerEngine: \"'_num_layers_per_chunk' must be provided when delay_wgrad_compute is True\")", firstW)
		}
		if spec.NumSamples%(chunks*micro) != 0 {
			return nil, 0, invalidf("len(sample_args) = %d is not a multiple of num_model_chunks (%d) * num_microbatches (%d); without _num_layers_per_chunk every chunk has len(sample_args) / (chunks * microbatches) layers", spec.NumSamples, chunks, micro)
		}
		l := spec.NumSamples / chunks / micro
		layers = make([]int, chunks)
		for i := range layers {
			layers[i] = l
		}
	case spec.LayersScalar:
		l := layers[0]
		layers = make([]int, chunks)
		for i := range layers {
			layers[i] = l
		}
	case len(layers) != chunks:
		return nil, 0, invalidf("_num_layers_per_chunk has %d entries but _order has %d chunks (its largest forward chunk id); it must be an integer or a list of %d integers", len(layers), chunks, chunks)
	}
	total := 0
	for c, l := range layers {
		if l < 1 {
			return nil, 0, invalidf("_num_layers_per_chunk[%d] = %d: every chunk needs at least one layer", c, l)
		}
		if firstW != nil && l != 1 {
			return nil, 0, invalidf("%s: with weight-gradient entries every chunk must have exactly one layer, but chunk %d has %d (TransformerEngine treats each layer as a chunk when wgrad is delayed)", firstW, c+1, l)
		}
		total += l
		if total > MaxChunk {
			return nil, 0, invalidf("_num_layers_per_chunk adds up to more than %d layers", MaxChunk)
		}
	}
	if spec.NumCallables != total {
		return nil, 0, invalidf("callables should have %d entries (the sum of _num_layers_per_chunk) when _order is given, but got %d", total, spec.NumCallables)
	}
	if int64(total)*int64(micro) > MaxChunk || spec.NumSamples != total*micro {
		return nil, 0, invalidf("expected %d sample_args (one per layer per microbatch: %d layers * %d microbatches), but got %d", int64(total)*int64(micro), total, micro, spec.NumSamples)
	}

	return layers, total, nil
}

// addSteps appends the steps of every order entry: a chunk's forward runs
// its layers in order, its backward in reverse, a weight-gradient entry
// pairs with the chunk's latest backward.
func (p *Plan) addSteps(order []Entry, training bool, nonW int) error {
	chunks, micro, layers := p.Chunks, p.Microbatches, p.Layers
	fwd := make([]int, chunks+1)    // forwards run per chunk
	bwd := make([]int, chunks+1)    // backwards run per chunk
	wOf := make([]int, chunks+1)    // entry of the wgrad paired with the latest backward, -1 none
	lastB := make([]int, chunks+1)  // entry of the latest backward per chunk
	pendW := make([]bool, chunks+1) // the latest backward of the chunk still lacks its wgrad
	for c := range wOf {
		wOf[c], lastB[c] = -1, -1
	}
	for _, e := range order {
		c := e.Chunk
		if c > chunks {
			return invalidf("%s: chunk %d has no forward entries (the largest forward chunk id is %d)", e, c, chunks)
		}
		switch e.Kind {
		case Forward:
			if fwd[c] == micro {
				return invalidf("%s: forward of chunk %d for microbatch %d, but there are only %d microbatches (%d forward/backward entries / %d chunks%s)", e, c, fwd[c], micro, nonW, chunks, map[bool]string{true: " / 2", false: ""}[training])
			}
			for l := 0; l < layers[c-1]; l++ {
				p.Steps = append(p.Steps, Step{Kind: Forward, Pass: p.PassIndex(c, fwd[c], l), Callable: p.Prefix(c) + l, Entry: e.Index, Chunk: c, Layer: l, Micro: fwd[c]})
			}
			fwd[c]++
		case Backward:
			if bwd[c] == fwd[c] {
				return invalidf("%s: backward of chunk %d, microbatch %d, comes before its forward (only %d forward entries of chunk %d precede it); a microbatch runs forward before backward", e, c, bwd[c], fwd[c], c)
			}
			for l := layers[c-1] - 1; l >= 0; l-- {
				p.Steps = append(p.Steps, Step{Kind: Backward, Pass: p.PassIndex(c, bwd[c], l), Callable: p.Prefix(c) + l, Entry: e.Index, Chunk: c, Layer: l, Micro: bwd[c]})
			}
			lastB[c], pendW[c] = e.Index, true
			bwd[c]++
		case WGrad:
			if bwd[c] == 0 {
				return invalidf("%s: weight-gradient pass of chunk %d before any backward of chunk %d; a -(c+0.5) entry pairs with the latest backward (-c) of its chunk", e, c, c)
			}
			if !pendW[c] {
				return invalidf("%s: the latest backward of chunk %d (%s, microbatch %d) already has its weight-gradient pass (entry %d); a -(c+0.5) entry pairs with the latest backward of its chunk, so each must follow its own backward before the chunk's next one (TransformerEngine: \"Number of wgrad graph doesn't match number of dgrad graphs\")",
					e, c, entryName(order, lastB[c]), bwd[c]-1, wOf[c])
			}
			pendW[c], wOf[c] = false, e.Index
			p.Steps = append(p.Steps, Step{Kind: WGrad, Pass: p.PassIndex(c, bwd[c]-1, 0), Callable: p.Prefix(c), Entry: e.Index, Chunk: c, Layer: 0, Micro: bwd[c] - 1})
		}
	}
	return nil
}

func entryName(order []Entry, idx int) string {
	for _, e := range order {
		if e.Index == idx {
			return e.String()
		}
	}
	return fmt.Sprintf("_order entry %d", idx)
}

// Encode renders p for Python, which reads it once to know what each pass
// runs (the plan itself stays in Go behind a handle): a header line, then
// one line per step: "K pass callable entry chunk layer micro" with K one of
// F, B, W.
func (p *Plan) Encode() string {
	var b strings.Builder
	ordered := 0
	if p.Ordered {
		ordered = 1
	}
	fmt.Fprintf(&b, "schedule v1 ordered=%d chunks=%d microbatches=%d callables=%d passes=%d layers=%s\n",
		ordered, p.Chunks, p.Microbatches, p.Callables, p.Passes, joinInts(p.Layers))
	for _, s := range p.Steps {
		fmt.Fprintf(&b, "%c %d %d %d %d %d %d\n", byte(s.Kind), s.Pass, s.Callable, s.Entry, s.Chunk, s.Layer, s.Micro)
	}
	return b.String()
}

func joinInts(xs []int) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = strconv.Itoa(x)
	}
	return strings.Join(parts, ",")
}
