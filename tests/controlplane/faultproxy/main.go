// faultproxy: a TCP proxy on 127.0.0.1 between canaryd and the real kube-apiserver of
// `make e2e`, with the network faults the e2e tests switch on and off over a small
// HTTP control API. Test infrastructure only, standard library only.
//
// It exists beside Toxiproxy because Toxiproxy cannot make two of the faults canaryd
// must survive: its toxics apply to every link of a proxy, new links included, so it
// cannot leave established connections half-open while new ones work; and its
// listener always completes the TCP handshake, so it cannot black-hole an address
// (a connect that times out).
//
//	POST /freeze      half-open: established connections stop forwarding in both
//	                  directions, with no FIN or RST; new connections work
//	POST /blackhole   the address stops answering: new connects time out (SYNs are
//	                  dropped: a listener with a full accept queue) and established
//	                  connections freeze
//	POST /latency?ms=N  N ms added to everything the server sends (a brownout)
//	POST /reset       every established connection is reset (RST)
//	POST /cut?bytes=N the next answer is lost: the first link on which the client sends
//	                  N bytes or more from now on is reset (RST) when the server's next
//	                  bytes come back, instead of passing them on. The server got the
//	                  whole request (a write: applied); the client cannot tell. N above a
//	                  TLS ClientHello keeps a new connection's handshake out of it
//	GET  /cuts        how many answers were cut
//	POST /outage?after_bytes=N  the API server goes away behind a load balancer that
//	                  still answers (Envoy's 503 "no healthy upstream", text/plain, over
//	                  TLS with -cert and -key): every link is reset, and every request
//	                  on a new connection is answered so. With after_bytes, it begins
//	                  after an answer: from now, what the server sends on the links open
//	                  now is held, until a client sends N bytes or more on one (a write);
//	                  that answer is passed on, then the outage begins (what was held, a
//	                  watch event, is lost), and that link is closed when its client
//	                  sends again. Not with /cut at once (they count the same bytes)
//	GET  /outage      off, armed or on
//	POST /heal        no fault any more (no outage); frozen connections are closed, as a client
//	                  finally gives a half-open connection up
//	GET  /links       how many connections are open
//
// Usage: faultproxy -upstream HOST:PORT [-cert FILE -key FILE]; it prints "proxy ADDR control ADDR".
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

type link struct {
	client, server net.Conn
	frozen         atomic.Bool
	held           atomic.Bool // open when an outage was armed: nothing passed on
	last           atomic.Bool // its answer began the outage: closed on its next request
	closed         atomic.Bool
	sent           atomic.Int64 // bytes from the client since /cut or /outage was armed
	once           sync.Once
}

func (l *link) close(reset bool) {
	l.once.Do(func() {
		l.closed.Store(true)
		if reset {
			if tc, ok := l.client.(*net.TCPConn); ok {
				_ = tc.SetLinger(0) // close sends RST
			}
		}
		_ = l.client.Close()
		_ = l.server.Close()
	})
}

type proxy struct {
	upstream string
	addr     *net.TCPAddr
	latency  atomic.Int64 // nanoseconds, server to client
	cut      atomic.Int64 // armed: bytes a client must send before its answer is cut
	cuts     atomic.Int64
	outage   atomic.Int64 // 0 none, -1 on, N > 0 armed: after an answer to N bytes
	gateway  *gateway     // answers for the server in an outage (-cert, -key)

	mu        sync.Mutex
	links     map[*link]struct{}
	listener  net.Listener
	blackhole *blackhole
}

// blackhole is a listening socket with a backlog of 0 whose accept queue is full and
// never drained: the kernel drops further SYNs, so a connect times out.
type blackhole struct {
	fd      int
	fillers []net.Conn
}

func openBlackhole(addr *net.TCPAddr) (*blackhole, error) {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		return nil, err
	}
	_ = syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1)
	sa := &syscall.SockaddrInet4{Port: addr.Port}
	copy(sa.Addr[:], addr.IP.To4())
	if err := syscall.Bind(fd, sa); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	if err := syscall.Listen(fd, 0); err != nil {
		syscall.Close(fd)
		return nil, err
	}
	b := &blackhole{fd: fd}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for i := 0; i < 3; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if c, err := net.DialTimeout("tcp", addr.String(), 300*time.Millisecond); err == nil {
				mu.Lock()
				b.fillers = append(b.fillers, c)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return b, nil
}

func (b *blackhole) close() {
	for _, c := range b.fillers {
		_ = c.Close()
	}
	_ = syscall.Close(b.fd)
}

func (p *proxy) serve(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return // closed: black-holed, or shutting down
		}
		go p.handle(c)
	}
}

// gateway hands the connections made in an outage to an HTTPS server that answers
// every request as a load balancer with no server behind it does.
type gateway struct {
	conns chan net.Conn
	addr  net.Addr
}

func (g *gateway) Accept() (net.Conn, error) { return <-g.conns, nil }
func (g *gateway) Close() error              { return nil }
func (g *gateway) Addr() net.Addr            { return g.addr }

func noHealthyUpstream(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/plain")
	w.Header().Set("Connection", "close") // a connection made in the outage ends with it
	w.WriteHeader(http.StatusServiceUnavailable)
	_, _ = io.WriteString(w, "no healthy upstream")
}

// resetAll resets every link but `keep` (p.mu held); returns how many.
func (p *proxy) resetAll(keep *link) int {
	n := 0
	for l := range p.links {
		if l != keep {
			l.close(true)
			n++
		}
	}
	return n
}

func (p *proxy) handle(client net.Conn) {
	if p.outage.Load() < 0 {
		p.gateway.conns <- client
		return
	}
	server, err := net.DialTimeout("tcp", p.upstream, 5*time.Second)
	if err != nil {
		_ = client.Close()
		return
	}
	l := &link{client: client, server: server}
	p.mu.Lock()
	if p.blackhole != nil {
		l.frozen.Store(true) // accepted just before the black hole
	}
	p.links[l] = struct{}{}
	p.mu.Unlock()
	done := make(chan struct{}, 2)
	go func() { p.pipe(l, server, client, false); done <- struct{}{} }()
	go func() { p.pipe(l, client, server, true); done <- struct{}{} }()
	<-done
	<-done
	l.close(false)
	p.mu.Lock()
	delete(p.links, l)
	p.mu.Unlock()
}

type chunk struct {
	data []byte
	at   time.Time
}

// pipe copies src to dst in order. Each chunk is stamped when read, and written
// `latency` after that (downstream only); while the link is frozen nothing is
// written and nothing is closed.
func (p *proxy) pipe(l *link, dst, src net.Conn, downstream bool) {
	chunks := make(chan chunk, 256)
	go func() {
		defer close(chunks)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				chunks <- chunk{buf[:n], time.Now()}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range chunks {
		if downstream {
			if d := time.Duration(p.latency.Load()); d > 0 {
				time.Sleep(time.Until(c.at.Add(d)))
			}
		}
		for l.frozen.Load() {
			time.Sleep(10 * time.Millisecond)
		}
		begins := false
		if downstream {
			for l.held.Load() && !l.closed.Load() {
				n := p.outage.Load()
				if n == 0 || (n > 0 && l.sent.Load() >= n) {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			if n := p.outage.Load(); n > 0 && l.sent.Load() >= n && p.outage.CompareAndSwap(n, -1) {
				begins = true // this answer passes, then the outage begins
				l.held.Store(false)
				l.last.Store(true)
			}
		} else if l.last.Load() {
			l.close(false) // the next request of the link whose answer began the outage
			break
		}
		if l.closed.Load() {
			break
		}
		if downstream {
			if n := p.cut.Load(); n > 0 && l.sent.Load() >= n && p.cut.CompareAndSwap(n, 0) {
				p.cuts.Add(1)
				l.close(true)
				break
			}
		}
		if !downstream && (p.cut.Load() > 0 || p.outage.Load() > 0) {
			l.sent.Add(int64(len(c.data))) // counted before the server can answer it
		}
		if _, err := dst.Write(c.data); err != nil {
			break
		}
		if begins {
			p.mu.Lock()
			p.resetAll(l)
			p.mu.Unlock()
		}
	}
	for l.frozen.Load() {
		time.Sleep(10 * time.Millisecond) // a frozen link tells nothing, not even EOF
	}
	if tc, ok := dst.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	} else {
		_ = dst.Close()
	}
	_, _ = io.Copy(io.Discard, src)
}

func (p *proxy) freezeAll() int {
	n := 0
	for l := range p.links {
		l.frozen.Store(true)
		n++
	}
	return n
}

func (p *proxy) control() http.Handler {
	mux := http.NewServeMux()
	reply := func(w http.ResponseWriter, format string, args ...any) {
		fmt.Fprintf(w, format+"\n", args...)
	}
	mux.HandleFunc("POST /freeze", func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		defer p.mu.Unlock()
		reply(w, "froze %d", p.freezeAll())
	})
	mux.HandleFunc("POST /blackhole", func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.blackhole == nil {
			_ = p.listener.Close()
			b, err := openBlackhole(p.addr)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			p.blackhole = b
		}
		reply(w, "black hole; froze %d", p.freezeAll())
	})
	mux.HandleFunc("POST /latency", func(w http.ResponseWriter, r *http.Request) {
		ms, err := strconv.Atoi(r.URL.Query().Get("ms"))
		if err != nil || ms < 0 {
			http.Error(w, "ms: a number of milliseconds", http.StatusBadRequest)
			return
		}
		p.latency.Store(int64(time.Duration(ms) * time.Millisecond))
		reply(w, "latency %d ms", ms)
	})
	mux.HandleFunc("POST /reset", func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		defer p.mu.Unlock()
		reply(w, "reset %d", p.resetAll(nil))
	})
	mux.HandleFunc("POST /outage", func(w http.ResponseWriter, r *http.Request) {
		if p.gateway == nil {
			http.Error(w, "start the proxy with -cert and -key", http.StatusBadRequest)
			return
		}
		n := 0
		if s := r.URL.Query().Get("after_bytes"); s != "" {
			var err error
			if n, err = strconv.Atoi(s); err != nil || n <= 0 {
				http.Error(w, "after_bytes: a positive number", http.StatusBadRequest)
				return
			}
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		if n == 0 {
			p.outage.Store(-1)
			reply(w, "outage; reset %d", p.resetAll(nil))
			return
		}
		for l := range p.links {
			l.sent.Store(0)
			l.held.Store(true)
		}
		p.outage.Store(int64(n))
		reply(w, "outage after the answer to %d bytes; holding %d", n, len(p.links))
	})
	mux.HandleFunc("GET /outage", func(w http.ResponseWriter, r *http.Request) {
		switch n := p.outage.Load(); {
		case n > 0:
			reply(w, "armed")
		case n < 0:
			reply(w, "on")
		default:
			reply(w, "off")
		}
	})
	mux.HandleFunc("POST /cut", func(w http.ResponseWriter, r *http.Request) {
		n, err := strconv.Atoi(r.URL.Query().Get("bytes"))
		if err != nil || n <= 0 {
			http.Error(w, "bytes: a positive number", http.StatusBadRequest)
			return
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		for l := range p.links {
			l.sent.Store(0)
		}
		p.cut.Store(int64(n))
		reply(w, "cutting the next answer after %d bytes", n)
	})
	mux.HandleFunc("GET /cuts", func(w http.ResponseWriter, r *http.Request) {
		reply(w, "%d", p.cuts.Load())
	})
	mux.HandleFunc("POST /heal", func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		defer p.mu.Unlock()
		p.latency.Store(0)
		p.cut.Store(0)
		p.outage.Store(0)
		closed := 0
		for l := range p.links {
			if l.frozen.Load() {
				l.close(false)
				closed++
			}
		}
		if p.blackhole != nil {
			p.blackhole.close()
			p.blackhole = nil
			l, err := net.ListenTCP("tcp", p.addr)
			if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			p.listener = l
			go p.serve(l)
		}
		reply(w, "healed; closed %d frozen", closed)
	})
	mux.HandleFunc("GET /links", func(w http.ResponseWriter, r *http.Request) {
		p.mu.Lock()
		defer p.mu.Unlock()
		reply(w, "%d", len(p.links))
	})
	return mux
}

func main() {
	upstream := flag.String("upstream", "", "HOST:PORT of the server behind the proxy")
	listen := flag.String("listen", "127.0.0.1:0", "the proxy's address")
	controlAddr := flag.String("control", "127.0.0.1:0", "the control API's address")
	cert := flag.String("cert", "", "the TLS certificate to answer with in an outage")
	key := flag.String("key", "", "its private key")
	flag.Parse()
	if *upstream == "" {
		fmt.Fprintln(os.Stderr, "faultproxy: -upstream HOST:PORT is required")
		os.Exit(2)
	}
	l, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatal(err)
	}
	p := &proxy{upstream: *upstream, addr: l.Addr().(*net.TCPAddr), links: map[*link]struct{}{}, listener: l}
	c, err := net.Listen("tcp", *controlAddr)
	if err != nil {
		log.Fatal(err)
	}
	if *cert != "" {
		p.gateway = &gateway{conns: make(chan net.Conn), addr: l.Addr()}
		quiet := log.New(io.Discard, "", 0) // clients that go away mid-handshake
		gw := &http.Server{Handler: http.HandlerFunc(noHealthyUpstream), ErrorLog: quiet}
		go func() { log.Fatal(gw.ServeTLS(p.gateway, *cert, *key)) }()
	}
	fmt.Printf("proxy %s control %s\n", l.Addr(), c.Addr())
	go p.serve(l)
	log.Fatal(http.Serve(c, p.control()))
}
