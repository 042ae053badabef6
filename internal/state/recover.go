package state

import "fmt"

// recoveringGraphs wraps a Graphs so that a panic in Launch or Destroy comes
// back as an error. Without it a panic inside reset (records hold their lock
// with a deferred unlock, so that part is safe) would leave a record with
// some graphs zeroed, its lifecycle unchanged and its pool references never
// handed back; with it, reset's error path runs: the other graphs are still
// destroyed, the pass is Reset and its references returned.
type recoveringGraphs struct{ g Graphs }

func recoverGraphs(g Graphs) Graphs {
	if r, ok := g.(recoveringGraphs); ok {
		return r
	}
	return recoveringGraphs{g}
}

func catchPanic(op string, graph int64, err *error) {
	if v := recover(); v != nil {
		*err = fmt.Errorf("%s of graph %d: internal panic: %v", op, graph, v)
	}
}

func (r recoveringGraphs) Launch(graph, stream int64) (err error) {
	defer catchPanic("launch", graph, &err)
	return r.g.Launch(graph, stream)
}

func (r recoveringGraphs) Destroy(graph int64) (err error) {
	defer catchPanic("destroy", graph, &err)
	return r.g.Destroy(graph)
}
