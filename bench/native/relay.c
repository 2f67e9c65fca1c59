/* Two relays that parse nothing, in C, for bench_proxy.py: what a native path costs.
 *
 * Side: an asyncio Protocol as a C type. The loop (uvloop) calls its data_received with
 * the bytes it read; it hands them to the peer transport's write. Flow control: the
 * peer's reading pauses while this side's transport is over its high-water mark.
 *
 * Relay: a native thread with its own epoll. add(client_fd, upstream_fd) gives it a pair
 * of connected non-blocking sockets; it relays both ways (one read, then a write, per
 * wake-up; what a write does not take waits and pauses the reading side) until either
 * side closes or fails, then hands the pair back: fileno() becomes readable and
 * finished() returns (client_fd, upstream_fd, reason) for each pair handed back. The
 * fds are the caller's to close. add(client_fd, upstream_fd, True) hands the pair back
 * ("lent back") as soon as what came from the upstream is all written to the client: what
 * lending a connection to native code and taking it back costs. The thread never takes
 * the GIL. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

/* ---- Side ------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *on_made;    /* callable(side) from connection_made, or None */
    PyObject *transport;  /* this side's transport */
    PyObject *peer;       /* the other side's transport, once there is one */
    PyObject *peer_write; /* peer.write, bound once */
    PyObject *held;       /* bytes that came before the peer did */
    int closed;
} Side;

static int Side_init(Side *self, PyObject *args, PyObject *kwds) {
    PyObject *on_made = Py_None;
    static char *kwlist[] = {"on_made", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O", kwlist, &on_made)) return -1;
    Py_INCREF(on_made);
    Py_XSETREF(self->on_made, on_made);
    return 0;
}

static int Side_traverse(Side *self, visitproc visit, void *arg) {
    Py_VISIT(self->on_made);
    Py_VISIT(self->transport);
    Py_VISIT(self->peer);
    Py_VISIT(self->peer_write);
    Py_VISIT(self->held);
    return 0;
}

static int Side_clear(Side *self) {
    Py_CLEAR(self->on_made);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->peer);
    Py_CLEAR(self->peer_write);
    Py_CLEAR(self->held);
    return 0;
}

static void Side_dealloc(Side *self) {
    PyObject_GC_UnTrack(self);
    Side_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *call_peer(Side *self, const char *name) {
    if (self->peer == NULL) Py_RETURN_NONE;
    return PyObject_CallMethod(self->peer, name, NULL);
}

static PyObject *Side_connection_made(Side *self, PyObject *transport) {
    Py_INCREF(transport);
    Py_XSETREF(self->transport, transport);
    if (self->on_made != NULL && self->on_made != Py_None)
        return PyObject_CallOneArg(self->on_made, (PyObject *)self);
    Py_RETURN_NONE;
}

static PyObject *Side_data_received(Side *self, PyObject *data) {
    if (self->peer_write != NULL) return PyObject_CallOneArg(self->peer_write, data);
    if (self->held == NULL && (self->held = PyList_New(0)) == NULL) return NULL;
    if (PyList_Append(self->held, data) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Side_eof_received(Side *self, PyObject *unused) {
    Py_RETURN_NONE; /* the transport closes; connection_lost closes the peer */
}

static PyObject *Side_connection_lost(Side *self, PyObject *exc) {
    self->closed = 1;
    PyObject *r = call_peer(self, "close");
    Py_CLEAR(self->peer_write);
    Py_CLEAR(self->peer);
    Py_CLEAR(self->transport);
    Py_CLEAR(self->on_made);
    Py_CLEAR(self->held);
    return r;
}

static PyObject *Side_pause_writing(Side *self, PyObject *unused) {
    return call_peer(self, "pause_reading");
}

static PyObject *Side_resume_writing(Side *self, PyObject *unused) {
    return call_peer(self, "resume_reading");
}

/* set_peer(transport): where this side's bytes go from now on (what was held goes first).
 * A side that has lost its connection closes the peer instead. */
static PyObject *Side_set_peer(Side *self, PyObject *peer) {
    if (self->closed) return PyObject_CallMethod(peer, "close", NULL);
    PyObject *write = PyObject_GetAttrString(peer, "write");
    if (write == NULL) return NULL;
    Py_INCREF(peer);
    Py_XSETREF(self->peer, peer);
    Py_XSETREF(self->peer_write, write);
    if (self->held != NULL) {
        PyObject *held = self->held;
        self->held = NULL;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(held); i++) {
            PyObject *r = PyObject_CallOneArg(write, PyList_GET_ITEM(held, i));
            if (r == NULL) {
                Py_DECREF(held);
                return NULL;
            }
            Py_DECREF(r);
        }
        Py_DECREF(held);
    }
    Py_RETURN_NONE;
}

static PyMethodDef Side_methods[] = {
    {"connection_made", (PyCFunction)Side_connection_made, METH_O, NULL},
    {"data_received", (PyCFunction)Side_data_received, METH_O, NULL},
    {"eof_received", (PyCFunction)Side_eof_received, METH_NOARGS, NULL},
    {"connection_lost", (PyCFunction)Side_connection_lost, METH_O, NULL},
    {"pause_writing", (PyCFunction)Side_pause_writing, METH_NOARGS, NULL},
    {"resume_writing", (PyCFunction)Side_resume_writing, METH_NOARGS, NULL},
    {"set_peer", (PyCFunction)Side_set_peer, METH_O, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Side_members[] = {
    {"transport", T_OBJECT, offsetof(Side, transport), READONLY, NULL},
    {"closed", T_INT, offsetof(Side, closed), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SideType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_bench_relay.Side",
    .tp_basicsize = sizeof(Side),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "an asyncio Protocol that relays what it receives to a peer transport",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Side_init,
    .tp_dealloc = (destructor)Side_dealloc,
    .tp_traverse = (traverseproc)Side_traverse,
    .tp_clear = (inquiry)Side_clear,
    .tp_methods = Side_methods,
    .tp_members = Side_members,
};

/* ---- Relay ------------------------------------------------------------------------ */

#define BUF (64 * 1024)
#define EVENTS 64

struct pair;

struct end {
    int fd;
    int idx;              /* 0 the client, 1 the upstream */
    uint32_t events;      /* what is registered */
    int eof;              /* a read from this fd returned 0 */
    char *pend;           /* bytes waiting to be written to this fd */
    size_t pend_len, pend_off;
    struct pair *pair;
};

struct pair {
    struct end end[2];
    int once;             /* handed back after each response byte run written to the client */
    const char *reason;   /* why it was handed back, once it is */
    struct pair *next;
};

typedef struct {
    PyObject_HEAD
    int epfd;
    int donefd;           /* eventfd: pairs handed back */
    int stopfd;           /* eventfd: the thread ends */
    pthread_t thread;
    int running;
    pthread_mutex_t lock;
    struct pair *done;    /* handed back, not yet taken by finished() */
    unsigned long long pairs;
} Relay;

static void want(Relay *r, struct end *e) {
    uint32_t ev = 0;
    struct end *other = &e->pair->end[!e->idx];
    if (!e->eof && other->pend_len == 0) ev |= EPOLLIN; /* read only what can be written on */
    if (e->pend_len) ev |= EPOLLOUT;
    if (ev != e->events) {
        struct epoll_event x = {.events = ev, .data.ptr = e};
        epoll_ctl(r->epfd, EPOLL_CTL_MOD, e->fd, &x);
        e->events = ev;
    }
}

static void finish(struct pair *p, const char *reason, struct pair **batch, int epfd) {
    if (p->reason) return;
    p->reason = reason;
    for (int i = 0; i < 2; i++) {
        epoll_ctl(epfd, EPOLL_CTL_DEL, p->end[i].fd, NULL);
        free(p->end[i].pend);
        p->end[i].pend = NULL;
        p->end[i].pend_len = 0;
    }
    p->next = *batch;
    *batch = p;
}

/* Write what waits for e; 1 when all of it went, 0 when some still waits, -1 on error. */
static int flush(struct end *e) {
    while (e->pend_off < e->pend_len) {
        ssize_t n = write(e->fd, e->pend + e->pend_off, e->pend_len - e->pend_off);
        if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
        e->pend_off += (size_t)n;
    }
    free(e->pend);
    e->pend = NULL;
    e->pend_len = e->pend_off = 0;
    return 1;
}

static void *relay_thread(void *arg) {
    Relay *r = arg;
    char *buf = malloc(BUF);
    struct epoll_event evs[EVENTS];
    if (buf == NULL) return NULL;
    for (;;) {
        int n = epoll_wait(r->epfd, evs, EVENTS, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        struct pair *batch = NULL;
        int stop = 0;
        for (int i = 0; i < n; i++) {
            if (evs[i].data.ptr == NULL) {
                stop = 1;
                continue;
            }
            struct end *e = evs[i].data.ptr;
            struct pair *p = e->pair;
            struct end *to = &p->end[!e->idx];
            uint32_t ev = evs[i].events;
            if (p->reason) continue;
            if (ev & EPOLLOUT) {
                int f = flush(e);
                if (f < 0) {
                    finish(p, "write failed", &batch, r->epfd);
                    continue;
                }
                if (f > 0 && to->eof) {
                    finish(p, e->idx ? "client closed" : "upstream closed", &batch, r->epfd);
                    continue;
                }
                if (f > 0 && p->once && e->idx == 0) {
                    finish(p, "lent back", &batch, r->epfd);
                    continue;
                }
                want(r, e);
                want(r, to);
            }
            if (ev & EPOLLERR) {
                finish(p, e->idx ? "upstream failed" : "client failed", &batch, r->epfd);
                continue;
            }
            if (ev & (EPOLLIN | EPOLLHUP) && (e->eof || to->pend_len)) {
                /* Not reading now; a hang-up (both ways shut) would be reported again
                 * at every wait until the pair ends. */
                if (ev & EPOLLHUP)
                    finish(p, e->idx ? "upstream closed" : "client closed", &batch, r->epfd);
                continue;
            }
            if (ev & (EPOLLIN | EPOLLHUP)) {
                ssize_t got = read(e->fd, buf, BUF);
                if (got < 0) {
                    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
                    finish(p, e->idx ? "upstream failed" : "client failed", &batch, r->epfd);
                    continue;
                }
                if (got == 0) {
                    e->eof = 1;
                    if (to->pend_len == 0)
                        finish(p, e->idx ? "upstream closed" : "client closed", &batch, r->epfd);
                    else
                        want(r, e);
                    continue;
                }
                ssize_t put = write(to->fd, buf, (size_t)got);
                if (put < 0) {
                    if (errno != EAGAIN && errno != EWOULDBLOCK) {
                        finish(p, "write failed", &batch, r->epfd);
                        continue;
                    }
                    put = 0;
                }
                if (put < got) {
                    to->pend = malloc((size_t)(got - put));
                    if (to->pend == NULL) {
                        finish(p, "out of memory", &batch, r->epfd);
                        continue;
                    }
                    memcpy(to->pend, buf + put, (size_t)(got - put));
                    to->pend_len = (size_t)(got - put);
                    to->pend_off = 0;
                    want(r, to);
                    want(r, e);
                } else if (p->once && to->idx == 0) {
                    finish(p, "lent back", &batch, r->epfd);
                }
            }
        }
        if (batch != NULL) { /* handed back after the batch: no event of it is left to read */
            pthread_mutex_lock(&r->lock);
            struct pair *last = batch;
            while (last->next) last = last->next;
            last->next = r->done;
            r->done = batch;
            pthread_mutex_unlock(&r->lock);
            uint64_t one = 1;
            if (write(r->donefd, &one, sizeof one) < 0) { /* the count is full: it is readable */
            }
        }
        if (stop) break;
    }
    free(buf);
    return NULL;
}

static int Relay_init(Relay *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "", kwlist)) return -1;
    if (self->running) {
        PyErr_SetString(PyExc_RuntimeError, "the relay runs already");
        return -1;
    }
    self->epfd = epoll_create1(EPOLL_CLOEXEC);
    self->donefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    self->stopfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (self->epfd < 0 || self->donefd < 0 || self->stopfd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event x = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, self->stopfd, &x) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_mutex_init(&self->lock, NULL);
    int err = pthread_create(&self->thread, NULL, relay_thread, self);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->running = 1;
    return 0;
}

static PyObject *Relay_add(Relay *self, PyObject *args) {
    int cfd, ufd, once = 0;
    if (!PyArg_ParseTuple(args, "ii|p", &cfd, &ufd, &once)) return NULL;
    if (!self->running) {
        PyErr_SetString(PyExc_ValueError, "the relay is closed");
        return NULL;
    }
    struct pair *p = calloc(1, sizeof *p);
    if (p == NULL) return PyErr_NoMemory();
    p->once = once;
    int fds[2] = {cfd, ufd};
    for (int i = 0; i < 2; i++) {
        p->end[i].fd = fds[i];
        p->end[i].idx = i;
        p->end[i].pair = p;
        p->end[i].events = EPOLLIN;
    }
    for (int i = 0; i < 2; i++) {
        struct epoll_event x = {.events = EPOLLIN, .data.ptr = &p->end[i]};
        if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, fds[i], &x) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            if (i == 1) epoll_ctl(self->epfd, EPOLL_CTL_DEL, fds[0], NULL);
            free(p);
            return NULL;
        }
    }
    self->pairs++;
    Py_RETURN_NONE;
}

static PyObject *Relay_finished(Relay *self, PyObject *unused) {
    uint64_t count;
    if (read(self->donefd, &count, sizeof count) < 0 && errno != EAGAIN) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    pthread_mutex_lock(&self->lock);
    struct pair *p = self->done;
    self->done = NULL;
    pthread_mutex_unlock(&self->lock);
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    while (p != NULL) {
        struct pair *next = p->next;
        PyObject *t = Py_BuildValue("iis", p->end[0].fd, p->end[1].fd, p->reason);
        free(p);
        if (t == NULL || PyList_Append(out, t) < 0) {
            Py_XDECREF(t);
            Py_DECREF(out);
            for (p = next; p != NULL; p = next) {
                next = p->next;
                free(p);
            }
            return NULL;
        }
        Py_DECREF(t);
        p = next;
    }
    return out;
}

static PyObject *Relay_fileno(Relay *self, PyObject *unused) {
    return PyLong_FromLong(self->donefd);
}

static void relay_stop(Relay *self) {
    if (!self->running) return;
    uint64_t one = 1;
    if (write(self->stopfd, &one, sizeof one) < 0) {
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    self->running = 0;
}

static PyObject *Relay_close(Relay *self, PyObject *unused) {
    relay_stop(self);
    Py_RETURN_NONE;
}

static void Relay_dealloc(Relay *self) {
    relay_stop(self);
    /* Pairs still relaying or not yet taken: their fds are the caller's; the memory goes. */
    for (struct pair *p = self->done, *next; p != NULL; p = next) {
        next = p->next;
        free(p);
    }
    if (self->epfd > 0) close(self->epfd);
    if (self->donefd > 0) close(self->donefd);
    if (self->stopfd > 0) close(self->stopfd);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Relay_methods[] = {
    {"add", (PyCFunction)Relay_add, METH_VARARGS,
     "add(client_fd, upstream_fd, once=False): relay them (once: until a response is out)"},
    {"finished", (PyCFunction)Relay_finished, METH_NOARGS,
     "the pairs handed back since the last call: [(client_fd, upstream_fd, reason)]"},
    {"fileno", (PyCFunction)Relay_fileno, METH_NOARGS, "readable when a pair was handed back"},
    {"close", (PyCFunction)Relay_close, METH_NOARGS, "end the thread"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RelayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_bench_relay.Relay",
    .tp_basicsize = sizeof(Relay),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "a native thread with its own epoll that relays pairs of sockets",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Relay_init,
    .tp_dealloc = (destructor)Relay_dealloc,
    .tp_methods = Relay_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_bench_relay",
    .m_doc = "relays that parse nothing, in C",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__bench_relay(void) {
    if (PyType_Ready(&SideType) < 0 || PyType_Ready(&RelayType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&SideType);
    Py_INCREF(&RelayType);
    if (PyModule_AddObject(m, "Side", (PyObject *)&SideType) < 0 ||
        PyModule_AddObject(m, "Relay", (PyObject *)&RelayType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
