package state

import (
	"errors"
	"testing"
)

var errFuzzEnd = errors.New("injected driver failure")

// FuzzLifecycle decodes the input as a sequence of two-byte operations on a
// few pass slots and runs them against a Ledger and a simple model of it.
// Operations include the capture transaction's failure points (a begin the
// driver refuses, an end that fails, an abort, a capture left open).
// Invariants: nothing panics; a pass's observable state matches the model;
// a pass that is not ready never launches; every graph a pass took is
// destroyed exactly once (by the end) and no other graph is destroyed; the
// pool references handed back in total equal those taken.
func FuzzLifecycle(f *testing.F) {
	f.Add([]byte{0, 0, 1, 0, 1, 4, 4, 0, 5, 0, 6, 0, 6, 4, 7, 0, 6, 0, 7, 0})
	f.Add([]byte{0, 0, 0, 1, 1, 0, 3, 1, 4, 1, 5, 0, 5, 1, 10, 0, 7, 0, 8, 1})
	f.Add([]byte{0, 2, 2, 2, 2, 6, 5, 2, 6, 2, 6, 6, 6, 14, 8, 2, 8, 2, 9, 2})
	f.Fuzz(func(t *testing.T, data []byte) {
		const slots = 4
		type model struct {
			id         int64
			life       Lifecycle
			has        [NumKinds]bool
			graphs     [NumKinds]int64
			refs       int
			open       bool
			openKind   GraphKind
			openStream int64
		}
		fg := newFakeGraphs()
		l := NewLedger(fg)
		var m [slots]model
		owned := map[int64]bool{} // graphs a pass took (must be destroyed once)
		refsIn, refsOut := 0, 0

		// retire books a reset or drop: its refs count as handed back even
		// when a destroy failed (case 10), as ResetPass promises.
		retire := func(s int, n int) {
			refsOut += n
			m[s].life, m[s].graphs, m[s].refs, m[s].open = Reset, [NumKinds]int64{}, 0, false
		}

		for i := 0; i+1 < len(data); i += 2 {
			op, arg := data[i]%11, data[i+1]
			s := int(arg % slots)
			kind := GraphKind((arg / slots) % 4) // 3 is an unknown kind
			p := &m[s]
			totalLaunches := 0
			for _, n := range fg.launches {
				totalLaunches += n
			}
			switch op {
			case 0: // new pass in the slot (dropping what was there)
				if p.id != 0 {
					n, _ := l.DropPass(p.id)
					retire(s, n)
				}
				id, err := l.NewPass(int(arg), "p")
				if err != nil {
					t.Fatal(err)
				}
				*p = model{id: id}
			case 1: // begin a capture (streams 1..slots, or 0 = eager)
				stream := int64(0)
				if arg&0x80 == 0 {
					stream = int64(s + 1)
				}
				err := l.BeginCapture(p.id, kind, "pool", stream, 0)
				ok := p.id != 0 && kind.valid() && p.life == Building && !p.has[kind] && !p.open
				if (err == nil) != ok {
					t.Fatalf("begin slot %d kind %d: err %v, model ok %v", s, kind, err, ok)
				}
				if ok {
					p.open, p.openKind, p.openStream = true, kind, stream
					p.refs++
					refsIn++
				}
			case 2: // end the open capture
				if !p.open {
					if _, err := l.EndCapture(p.id, kind, 1); err == nil {
						t.Fatal("EndCapture succeeded without an open capture")
					}
					continue
				}
				if arg&0x80 != 0 { // the driver fails to end it
					fg.failEnd = errFuzzEnd
				}
				_, err := l.EndCapture(p.id, p.openKind, p.openStream)
				failed := fg.failEnd != nil && p.openStream != 0
				fg.failEnd = nil
				if (err != nil) != failed {
					t.Fatalf("end: err %v, model failed %v", err, failed)
				}
				if !failed {
					g, _ := l.Graph(p.id, p.openKind)
					if (g != 0) != (p.openStream != 0) {
						t.Fatalf("end attached graph %d for stream %d", g, p.openStream)
					}
					p.has[p.openKind], p.graphs[p.openKind] = true, g
					if g != 0 {
						owned[g] = true
					}
				}
				p.open = false
			case 3: // abort the open capture (or a harmless abort of none)
				if p.id == 0 {
					continue
				}
				if err := l.AbortCapture(p.id, p.openKind, p.openStream); err != nil {
					t.Fatalf("abort: %v", err)
				}
				p.open = false
			case 4: // a begin the driver refuses changes nothing
				fg.failBegin = errFuzzEnd
				err := l.BeginCapture(p.id, kind, "pool", int64(s+1), 0)
				fg.failBegin = nil
				if err == nil {
					t.Fatal("BeginCapture succeeded though the driver failed")
				}
			case 5:
				err := l.Seal(p.id)
				ok := p.id != 0 && p.life == Building && !p.open
				if (err == nil) != ok {
					t.Fatalf("seal: err %v, model ok %v", err, ok)
				}
				if ok {
					p.life = Ready
				}
			case 6:
				launched, err := l.Replay(p.id, kind, int64(arg))
				ok := p.id != 0 && kind.valid() && p.life == Ready && p.has[kind]
				if (err == nil) != ok {
					t.Fatalf("replay slot %d kind %d (state %v): err %v, model ok %v", s, kind, p.life, err, ok)
				}
				if launched != (ok && p.graphs[kind] != 0) {
					t.Fatalf("replay reported launched=%v, model graph %d ok %v", launched, p.graphs[kind], ok)
				}
				after := 0
				for _, n := range fg.launches {
					after += n
				}
				want := totalLaunches
				if ok && p.graphs[kind] != 0 {
					want++
				}
				if after != want {
					t.Fatalf("replay launched %d graphs, want %d (state %v)", after-totalLaunches, want-totalLaunches, p.life)
				}
			case 7:
				if p.id == 0 {
					continue
				}
				n, _ := l.ResetPass(p.id)
				if n != p.refs {
					t.Fatalf("reset returned %d refs, model %d", n, p.refs)
				}
				retire(s, n)
			case 8:
				if p.id == 0 {
					continue
				}
				n, _ := l.DropPass(p.id)
				if n != p.refs {
					t.Fatalf("drop returned %d refs, model %d", n, p.refs)
				}
				retire(s, n)
				if _, err := l.State(p.id); err == nil {
					t.Fatal("a dropped pass is still known")
				}
				*p = model{}
			case 9:
				if p.id == 0 {
					continue
				}
				st, err := l.State(p.id)
				if err != nil || st != p.life {
					t.Fatalf("state %v, %v; model %v", st, err, p.life)
				}
				if kind.valid() {
					if g, _ := l.Graph(p.id, kind); g != p.graphs[kind] {
						t.Fatalf("graph %d, model %d", g, p.graphs[kind])
					}
				}
			case 10: // the next destroy of this slot's graph of kind fails
				if kind.valid() && p.graphs[kind] != 0 {
					fg.failDestroy[p.graphs[kind]] = true
				}
			}
			if len(fg.violations) > 0 {
				t.Fatalf("graph misuse: %v", fg.violations)
			}
		}

		for s := range m {
			if m[s].id != 0 {
				n, _ := l.DropPass(m[s].id)
				retire(s, n)
			}
		}
		if l.LivePasses() != 0 {
			t.Fatalf("LivePasses = %d after dropping all", l.LivePasses())
		}
		if refsIn != refsOut {
			t.Fatalf("pool refs taken %d, handed back %d", refsIn, refsOut)
		}
		for g, n := range fg.destroyed {
			if !owned[g] || n != 1 {
				t.Fatalf("graph %d destroyed %d times (owned by a pass: %v)", g, n, owned[g])
			}
		}
		for g := range owned {
			if fg.destroyed[g] != 1 {
				t.Fatalf("graph %d owned by a pass was destroyed %d times", g, fg.destroyed[g])
			}
		}
		fg.check(t)
	})
}
