package lifetime

import (
	"fmt"
	"sort"
	"strings"
)

// OpKind is one instruction of a program.
type OpKind byte

// Warmup instructions (lower case) and capture instructions (upper case).
const (
	WarmForward  OpKind = 'f' // run the pass's forward eagerly
	WarmBackward OpKind = 'b' // run its backward on the outputs of its latest warmup forward
	WarmWGrad    OpKind = 'w' // run its delayed weight-gradient work
	DropWarm     OpKind = 'x' // its warmup outputs die
	// DropZeroGrads: the zero incoming grads made for its warmup backwards
	// die. Without capture-time hooks (which could write them) one pass's
	// zero grads serve its consecutive iterations: autograd only reads them.
	DropZeroGrads OpKind = 'g'
	// DropInference: its warmup outputs die here when none of them requires
	// grad: the pass turned out to have no backward (an eval module or
	// inputs and parameters that need no grad), which only its first forward
	// tells; its backward steps then run nothing.
	DropInference OpKind = 'y'

	CaptureForward  OpKind = 'F' // capture the pass's forward graph
	CaptureBackward OpKind = 'B' // capture its backward graph, differentiating its capture-time outputs
	CaptureWGrad    OpKind = 'W' // capture its weight-gradient graph
	DropCapture     OpKind = 'X' // its capture-time outputs (with their autograd graph) die
	Release         OpKind = 'R' // a pool buffer of the pass dies: hand it back to the pool
	// ReturnWarmupPool: the pool reference the build's warmup (in the graph
	// pool) or its pool seed took goes back: the captures hold theirs now,
	// and a pool whose last reference went cannot be captured into again.
	// Pass is NoPass.
	ReturnWarmupPool OpKind = 'H'
)

// NoPass is the Pass of an op that belongs to no pass (ReturnWarmupPool).
const NoPass = -1

// Op is one instruction. Role and Index name the buffer of a Release: output
// k (Role Output), the grad of user input leaf j (GradInput) or the
// parameter grad at static-surface index j (ParamGrad).
type Op struct {
	Kind  OpKind
	Pass  int
	Role  Role
	Index int
}

func (o Op) String() string {
	if o.Kind == Release {
		return fmt.Sprintf("R %c %d %d", byte(o.Role), o.Pass, o.Index)
	}
	return fmt.Sprintf("%c %d", byte(o.Kind), o.Pass)
}

// SourceKind says where a static buffer of a pass comes from.
type SourceKind byte

// Buffer sources.
const (
	Own     SourceKind = 'o' // the pass's own: its sample arg, or a new grad-output buffer
	Slot    SourceKind = 's' // a slot shared by liveness (Options.Reuse)
	Chained SourceKind = 'c' // another pass's buffer: the producer's output (inputs) or the consumer's input grad (grad outputs)
	None    SourceKind = '-' // no buffer (a grad output of an output that does not require grad)
	Fresh   SourceKind = 'n' // a new buffer, a copy of the sample, whose memory another input leaf or a parameter uses
)

// Source is where one static buffer comes from. For Chained, Pass and
// Index name the other pass's output (inputs) or user-input grad (grad
// outputs).
type Source struct {
	Kind  SourceKind
	Slot  int
	Pass  int
	Index int
}

// Program is a planned capture: the ops in order, and per pass where each
// static input leaf and each grad-output buffer comes from and how each
// parameter grad reaches .grad.
type Program struct {
	Ops         []Op
	Inputs      [][]Source     // [pass][input leaf]
	GradOutputs [][]Source     // [pass][output]
	GradPolicy  [][]GradPolicy // [pass][ParamGrads entry]
	Sigs        map[int]*SigStats
	Slots       int
	// LentFrom[i], for a capture op i (F, B or W), is the first op index
	// from which capturing a lending backward (LentOverwrites) makes its
	// lent parameter grads memory the graph of op i may overwrite at
	// replay; len(Ops) when no lending backward of this build is. Not set
	// (-1) for other ops.
	LentFrom []int
	// Share[pass] is the pass whose graphs and buffers it replays (itself
	// for a pass that captures its own; see share.go). A sharing pass has
	// no op, no buffer source and no policy of its own.
	Share []int
}

// Encode renders the program in the text form Python reads once per build:
//
//	op K pass                one capture or drop op (K one of F B W X)
//	op R role pass index     a release
//	in pass leaf o|n|s SLOT|c PASS OUTPUT
//	gout pass output o|-|s SLOT|c PASS LEAF
//	grad pass entry c|l|t    the policy of pass's ParamGrads[entry]
//	sig S buffers slots tefifo
//	slots N
//	lent K pass from         the graph of op K (pass's) overwrites grads lent by backwards captured from op "from" on
//	share pass rep           pass replays rep's graphs and buffers (it captures nothing)
func (p *Program) Encode() string {
	var b strings.Builder
	for _, o := range p.Ops {
		fmt.Fprintf(&b, "op %s\n", o)
	}
	for _, s := range p.Sharers() {
		fmt.Fprintf(&b, "share %d %d\n", s[0], s[1])
	}
	for i, from := range p.LentFrom {
		if from >= 0 {
			fmt.Fprintf(&b, "lent %c %d %d\n", byte(p.Ops[i].Kind), p.Ops[i].Pass, from)
		}
	}
	writeSources(&b, "in", p.Inputs)
	writeSources(&b, "gout", p.GradOutputs)
	for pass, pol := range p.GradPolicy {
		for i, g := range pol {
			fmt.Fprintf(&b, "grad %d %d %c\n", pass, i, byte(g))
		}
	}
	sigs := make([]int, 0, len(p.Sigs))
	for s := range p.Sigs {
		sigs = append(sigs, s)
	}
	sort.Ints(sigs)
	for _, s := range sigs {
		st := p.Sigs[s]
		fmt.Fprintf(&b, "sig %d %d %d %d\n", s, st.Buffers, st.Slots, st.TEFifo)
	}
	fmt.Fprintf(&b, "slots %d\n", p.Slots)
	return b.String()
}

func writeSources(b *strings.Builder, tag string, srcs [][]Source) {
	for pass, row := range srcs {
		for i, s := range row {
			switch s.Kind {
			case Slot:
				fmt.Fprintf(b, "%s %d %d s %d\n", tag, pass, i, s.Slot)
			case Chained:
				fmt.Fprintf(b, "%s %d %d c %d %d\n", tag, pass, i, s.Pass, s.Index)
			case None:
				fmt.Fprintf(b, "%s %d %d -\n", tag, pass, i)
			case Fresh:
				fmt.Fprintf(b, "%s %d %d n\n", tag, pass, i)
			}
			// Own is the default: not written.
		}
	}
}

// EncodeOps renders a warmup program: one "op K pass" line per op.
func EncodeOps(ops []Op) string {
	var b strings.Builder
	for _, o := range ops {
		fmt.Fprintf(&b, "op %s\n", o)
	}
	return b.String()
}
